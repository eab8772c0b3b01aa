use super::*;
use proptest::prelude::*;

const DAY: u64 = 86_400;

/// Unix seconds of a UTC civil time.
fn utc(year: i64, month: u8, day: u8, hour: u64) -> u64 {
    let days = civil::days_from_civil(civil::Ymd { year, month, day });
    u64::try_from(days).unwrap() * DAY + hour * 3_600
}

fn bounds(period: CalendarPeriod, unix_s: u64) -> (u64, u64) {
    let (start, end) = period.bounds_at(Duration::from_secs(unix_s));
    (start.as_secs(), end.as_secs())
}

#[test]
fn utc_periods_at_their_edges() {
    let jan_31_23h = utc(2025, 1, 31, 23);
    assert_eq!(
        bounds(CalendarPeriod::day(), jan_31_23h),
        (utc(2025, 1, 31, 0), utc(2025, 2, 1, 0))
    );
    // The example: a deny on Jan 31 at 23:00 UTC waits 3,600 s for the month.
    let (_, end) = bounds(CalendarPeriod::month(), jan_31_23h);
    assert_eq!(end - jan_31_23h, 3_600);
    // 2025-12-29 is a Monday: ISO week 1 of 2026 starts there.
    assert_eq!(
        bounds(CalendarPeriod::week(), utc(2026, 1, 1, 12)),
        (utc(2025, 12, 29, 0), utc(2026, 1, 5, 0))
    );
    assert_eq!(
        bounds(CalendarPeriod::year(), utc(2024, 12, 31, 23)),
        (utc(2024, 1, 1, 0), utc(2025, 1, 1, 0))
    );
    // The last instant of a period is in it; the first of the next is not.
    let (start, end) = CalendarPeriod::day()
        .bounds_at(Duration::from_nanos(utc(2025, 3, 1, 0) * 1_000_000_000 - 1));
    assert_eq!(
        (start.as_secs(), end.as_secs()),
        (utc(2025, 2, 28, 0), utc(2025, 3, 1, 0))
    );
}

#[test]
fn anchored_months_clamp_to_short_months() {
    let on = |day| CalendarPeriod::month().anchor(day).unwrap();
    // From the 15th: Feb 10 is in the period from Jan 15.
    assert_eq!(
        bounds(on(15), utc(2025, 2, 10, 0)),
        (utc(2025, 1, 15, 0), utc(2025, 2, 15, 0))
    );
    // From the 31st: February's period starts on its last day, in leap years the 29th.
    assert_eq!(
        bounds(on(31), utc(2024, 2, 29, 5)),
        (utc(2024, 2, 29, 0), utc(2024, 3, 31, 0))
    );
    assert_eq!(
        bounds(on(31), utc(2024, 2, 28, 5)),
        (utc(2024, 1, 31, 0), utc(2024, 2, 29, 0))
    );
    assert_eq!(
        bounds(on(29), utc(2025, 2, 28, 5)),
        (utc(2025, 2, 28, 0), utc(2025, 3, 29, 0))
    );
    assert_eq!(
        bounds(on(30), utc(2025, 4, 30, 1)),
        (utc(2025, 4, 30, 0), utc(2025, 5, 30, 0))
    );
    // A Feb 29 anchor is the 28th in other years.
    assert_eq!(
        bounds(on(29), utc(2023, 3, 1, 0)),
        (utc(2023, 2, 28, 0), utc(2023, 3, 29, 0))
    );
}

#[test]
fn bad_anchors_and_zones_are_typed_errors() {
    assert_eq!(
        CalendarPeriod::month().anchor(0),
        Err(ConfigError::InvalidAnchor {
            unit: "month",
            day: 0
        })
    );
    assert!(matches!(
        CalendarPeriod::month().anchor(32),
        Err(ConfigError::InvalidAnchor { .. })
    ));
    assert!(matches!(
        CalendarPeriod::day().anchor(15),
        Err(ConfigError::InvalidAnchor { unit: "day", .. })
    ));
    assert!(matches!(
        CalendarPeriod::day().tz("Mars/Olympus_Mons"),
        Err(ConfigError::UnknownTimeZone { .. })
    ));
    assert_eq!(
        CalendarPeriod::day().tz("UTC").unwrap(),
        CalendarPeriod::day()
    );
}

#[test]
fn one_calendar_per_description() {
    let a = CalendarPeriod::month().anchor(15).unwrap();
    let b = CalendarPeriod::month().anchor(15).unwrap();
    assert_eq!(a, b);
    assert!(std::ptr::eq(a.0, b.0));
    assert_ne!(a, CalendarPeriod::month());
    assert_eq!(a.to_string(), "month calendar anchor 15");
    assert_eq!(CalendarPeriod::week().to_string(), "week calendar");
}

/// The properties every period has, checked through the public bounds and the internal
/// span: it holds the instant, it starts on its first day's first instant, and it ends
/// where the next one starts.
fn check_span(period: CalendarPeriod, unix_s: u64) -> Result<(), TestCaseError> {
    let wall = unix_s * 1_000_000_000 + 123;
    let span = period.span_at(wall);
    prop_assert!(
        span.start <= wall && wall < span.end,
        "{span:?} holds {wall}"
    );
    prop_assert_eq!(period.start_of(span.index), span.start);
    prop_assert_eq!(period.start_of(span.index + 1), span.end);
    prop_assert_eq!(period.start_of(span.index + 2), span.next_end);
    let next = period.span_at(span.end);
    prop_assert!(next.index > span.index);
    prop_assert_eq!(next.start, span.end);
    let last = period.span_at(span.end - 1);
    prop_assert_eq!(last, span);
    if span.start > 0 {
        prop_assert!(period.span_at(span.start - 1).index < span.index);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3_000))]

    /// UTC periods over 1970–2514 against civil arithmetic: day lengths are 86,400 s,
    /// weeks start on Mondays, months on their anchor (clamped), years on January 1st.
    #[test]
    fn utc_periods_hold_their_instants(unix_s in 400_000_000u64..17_000_000_000, anchor in 1u8..=31, unit in 0usize..4) {
        let period = match unit {
            0 => CalendarPeriod::day(),
            1 => CalendarPeriod::week(),
            2 => CalendarPeriod::month().anchor(anchor).unwrap(),
            _ => CalendarPeriod::year(),
        };
        check_span(period, unix_s)?;
        let (start, end) = bounds(period, unix_s);
        let first = civil::civil_from_days((start / DAY) as i64);
        prop_assert_eq!(start % DAY, 0);
        match period.unit() {
            CalendarUnit::Day => prop_assert_eq!(end - start, DAY),
            CalendarUnit::Week => {
                prop_assert_eq!(end - start, 7 * DAY);
                prop_assert_eq!(civil::weekday_from_monday((start / DAY) as i64), 0);
            }
            CalendarUnit::Month => {
                prop_assert_eq!(first.day, anchor.min(civil::days_in_month(first.year, first.month)));
                prop_assert!((28 * DAY..=31 * DAY).contains(&(end - start)));
            }
            CalendarUnit::Year => prop_assert_eq!((first.month, first.day), (1, 1)),
        }
    }
}

#[cfg(feature = "calendar")]
mod zones {
    use super::*;
    use jiff::ToSpan;
    use jiff::civil::Date;
    use jiff::tz::TimeZone;

    /// The period's bounds computed with jiff's own calendar arithmetic, independently
    /// of the module's: the instant's local date, the period's first date by jiff's
    /// date arithmetic, and that date's start of day in the zone.
    fn reference(period: CalendarPeriod, zone: &TimeZone, unix_s: i64) -> (i64, i64) {
        let date = jiff::Timestamp::from_second(unix_s)
            .unwrap()
            .to_zoned_datetime(zone.clone())
            .date();
        let anchored = |d: Date| {
            let day = i8::try_from(period.anchor_day())
                .unwrap()
                .min(d.days_in_month());
            d.with().day(day).build().unwrap()
        };
        let (first, next) = match period.unit() {
            CalendarUnit::Day => (date, date.tomorrow().unwrap()),
            CalendarUnit::Week => {
                let monday = date
                    .checked_sub(i64::from(date.weekday().to_monday_zero_offset()).days())
                    .unwrap();
                (monday, monday.checked_add(7.days()).unwrap())
            }
            CalendarUnit::Month => {
                let this = anchored(date.first_of_month());
                let first = if date >= this {
                    this
                } else {
                    anchored(date.first_of_month().checked_sub(1.month()).unwrap())
                };
                (
                    first,
                    anchored(first.first_of_month().checked_add(1.month()).unwrap()),
                )
            }
            CalendarUnit::Year => (
                date.first_of_year(),
                date.first_of_year().checked_add(1.year()).unwrap(),
            ),
        };
        let start_of = |d: Date| {
            d.to_zoned_datetime(zone.clone())
                .unwrap()
                .start_of_day()
                .unwrap()
                .timestamp()
                .as_second()
        };
        (start_of(first), start_of(next))
    }

    fn named(unit: CalendarUnit, zone: &str, anchor: u8) -> CalendarPeriod {
        let period = CalendarPeriod::utc(unit).tz(zone).unwrap();
        if unit == CalendarUnit::Month {
            period.anchor(anchor).unwrap()
        } else {
            period
        }
    }

    #[test]
    fn daylight_saving_days_last_23_and_25_hours() {
        let paris = CalendarPeriod::day().tz("Europe/Paris").unwrap();
        // 2025-03-30: clocks go from 02:00 to 03:00; 2025-10-26: from 03:00 to 02:00.
        let (start, end) = bounds(paris, utc(2025, 3, 30, 12));
        assert_eq!((start, end - start), (utc(2025, 3, 29, 23), 23 * 3_600));
        let (start, end) = bounds(paris, utc(2025, 10, 26, 12));
        assert_eq!((start, end - start), (utc(2025, 10, 25, 22), 25 * 3_600));
        // São Paulo, 2018-11-04: midnight did not happen; the day began at 01:00 (-02).
        let sao_paulo = CalendarPeriod::day().tz("America/Sao_Paulo").unwrap();
        assert_eq!(
            bounds(sao_paulo, utc(2018, 11, 4, 12)).0,
            utc(2018, 11, 4, 3)
        );
        // Havana, 2023-11-05: clocks went from 01:00 back to 00:00; the day began at
        // the first midnight (-04).
        let havana = CalendarPeriod::day().tz("America/Havana").unwrap();
        let (start, end) = bounds(havana, utc(2023, 11, 5, 12));
        assert_eq!((start, end - start), (utc(2023, 11, 5, 4), 25 * 3_600));
        // Apia skipped 2011-12-30: the 29th ends where the 31st begins.
        let apia = CalendarPeriod::day().tz("Pacific/Apia").unwrap();
        let (_, end) = bounds(apia, utc(2011, 12, 29, 12));
        assert_eq!(bounds(apia, end).0, end);
        // A month in Paris: from local midnight of the 1st.
        let month = CalendarPeriod::month().tz("Europe/Paris").unwrap();
        assert_eq!(
            bounds(month, utc(2025, 1, 31, 23)),
            (utc(2025, 1, 31, 23), utc(2025, 2, 28, 23))
        );
        // Zone names are the database's: one calendar per zone, however spelled.
        assert_eq!(paris.zone(), "Europe/Paris");
        assert_eq!(paris.to_string(), "day calendar tz Europe/Paris");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4_000))]

        /// Every zone of the bundled database, instants from 1970 to 2100 (DST rules
        /// come and go over them), every unit, every anchor: the module's bounds are
        /// jiff's.
        #[test]
        fn named_zones_agree_with_jiff(zone_pick in any::<prop::sample::Index>(), unix_s in 0i64..4_102_444_800, unit in 0usize..4, anchor in 1u8..=31) {
            let names: Vec<_> = jiff::tz::db().available().map(|n| n.as_str().to_owned()).collect();
            let name = zone_pick.get(&names);
            let unit = [CalendarUnit::Day, CalendarUnit::Week, CalendarUnit::Month, CalendarUnit::Year][unit];
            let period = named(unit, name, anchor);
            let zone = jiff::tz::db().get(name).unwrap();
            let (start, end) = reference(period, &zone, unix_s);
            // Before 1970 the module starts at 0.
            let expected = (start.max(0) as u64, end as u64);
            prop_assert_eq!(bounds(period, unix_s as u64), expected, "{} at {}", period, unix_s);
            check_span(period, unix_s as u64)?;
        }
    }

    /// Every DST change of a few zones between 2000 and 2040, the instants on either
    /// side of each: the day holding it and the month holding it are jiff's.
    #[test]
    fn every_transition_of_a_few_zones() {
        for name in [
            "Europe/Paris",
            "America/New_York",
            "Australia/Lord_Howe",
            "America/Santiago",
            "Asia/Tehran",
            "Africa/Casablanca",
        ] {
            let zone = jiff::tz::db().get(name).unwrap();
            let mut at = jiff::Timestamp::from_second(946_684_800).unwrap();
            let mut transitions = 0;
            while let Some(t) = zone.following(at).next() {
                at = t.timestamp();
                if at.as_second() > 2_208_988_800 {
                    break;
                }
                transitions += 1;
                for s in [at.as_second() - 1, at.as_second()] {
                    for unit in [CalendarUnit::Day, CalendarUnit::Month] {
                        let period = named(unit, name, 1);
                        let (start, end) = reference(period, &zone, s);
                        assert_eq!(
                            bounds(period, s as u64),
                            (start as u64, end as u64),
                            "{period} at {s}"
                        );
                    }
                }
            }
            assert!(transitions > 0, "{name}: no transition found");
        }
    }
}
