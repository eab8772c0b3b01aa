//! Calendar quotas in the limiter: the window counters on days, weeks, months and years
//! in UTC and time zones, against a reference model that knows nothing but the
//! periods' bounds; the quota syntax; and what refuses them.

use std::time::Duration;

use proptest::prelude::*;
use tollgate::calendar::{CalendarPeriod, CalendarUnit};
use tollgate::clock::ManualClock;
use tollgate::{Algorithm, ConfigError, Decision, Quota, RateLimiter};

const SEC: u64 = 1_000_000_000;
/// 2025-01-31T23:00:00Z.
const JAN_31_23H: u64 = 1_738_364_400;

fn limiter(quota: &str, algorithm: Algorithm, unix_s: u64) -> RateLimiter<u64, ManualClock> {
    RateLimiter::builder(quota.parse().unwrap())
        .algorithm(algorithm)
        .clock(ManualClock::at_unix(Duration::from_secs(unix_s)))
        .build()
        .unwrap()
}

#[test]
fn the_pinned_strings_parse_and_print_back() {
    for text in [
        "1000/day calendar",
        "500/week calendar",
        "10000/month calendar",
        "100000/year calendar",
        "10000/month calendar anchor 15",
        "1/day calendar burst 5",
    ] {
        let quota: Quota = text.parse().unwrap();
        assert!(quota.calendar().is_some(), "{text}");
        assert_eq!(quota.to_string(), text);
        assert_eq!(quota.to_string().parse::<Quota>().unwrap(), quota);
    }
    // Options in any order; plain periods stay rolling.
    assert_eq!(
        "5/month anchor 31 calendar".parse::<Quota>().unwrap(),
        Quota::per_calendar(5, CalendarPeriod::month().anchor(31).unwrap()).unwrap()
    );
    let rolling: Quota = "1000/day".parse().unwrap();
    assert_eq!(
        (rolling.calendar(), rolling.period()),
        (None, Duration::from_secs(86_400))
    );
    assert_eq!(
        "7/week".parse::<Quota>().unwrap().period(),
        Duration::from_secs(7 * 86_400)
    );
    let month: Quota = "10000/month calendar".parse().unwrap();
    assert_eq!(month.period(), CalendarUnit::Month.nominal());
    assert_eq!(month.calendar().unwrap().unit(), CalendarUnit::Month);
}

#[test]
fn malformed_calendar_strings_say_what_to_write() {
    let cases = [
        ("10000/month", "\"10000/month calendar\""),
        ("5/2years", "\"5/year calendar\""),
        ("100/2day calendar", "one day, week, month or year"),
        ("100/h calendar", "one day, week, month or year"),
        ("100/day tz UTC", "apply to calendar periods"),
        ("100/day anchor 3", "apply to calendar periods"),
        ("100/day calendar anchor 3", "applies to calendar months"),
        ("100/month calendar anchor 0", "use 1 to 31"),
        ("100/month calendar anchor 32", "use 1 to 31"),
        (
            "100/month calendar anchor x",
            "the anchor day \"x\" is not a whole number",
        ),
        (
            "100/month calendar tz",
            "'tz' must be followed by a time zone name",
        ),
        (
            "100/month calendar tz Mars/Olympus",
            "unknown time zone \"Mars/Olympus\"",
        ),
        ("100/day calendar calendar", "\"calendar\" is given twice"),
        ("100/day calendar tz UTC tz UTC", "\"tz\" is given twice"),
    ];
    for (input, part) in cases {
        let err = input.parse::<Quota>().unwrap_err();
        assert!(
            matches!(err, ConfigError::InvalidQuotaString { .. }),
            "{input:?}: {err:?}"
        );
        assert!(
            err.to_string().contains(part),
            "{input:?}: {err} should mention {part:?}"
        );
    }
}

#[test]
fn only_the_window_counters_take_calendar_quotas() {
    let quota: Quota = "10/day calendar".parse().unwrap();
    for algorithm in [
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket,
        Algorithm::SlidingLog,
    ] {
        let err = RateLimiter::<u64>::builder(quota)
            .algorithm(algorithm)
            .build()
            .unwrap_err();
        assert!(
            matches!(err, ConfigError::CalendarUnsupported { .. }),
            "{algorithm}: {err:?}"
        );
        assert!(err.to_string().contains("Algorithm::FixedWindow"), "{err}");
        // Nor as a key's quota on a limiter of a rolling default.
        let rolling = RateLimiter::<u64>::builder("10/s".parse().unwrap())
            .algorithm(algorithm)
            .build()
            .unwrap();
        assert!(matches!(
            rolling.set_quota(&1, quota),
            Err(ConfigError::CalendarUnsupported { .. })
        ));
    }
}

/// The example: a deny on Jan 31 at 23:00 UTC waits 3,600 s, the month's end.
#[test]
fn a_deny_counts_to_the_real_boundary() {
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindow] {
        let limiter = limiter("2/month calendar", algorithm, JAN_31_23H);
        assert!(limiter.check(&1).is_allowed());
        let second = limiter.check(&1);
        assert_eq!((second.remaining(), second.is_allowed()), (0, true));
        let denied = limiter.check(&1);
        assert!(!denied.is_allowed());
        if algorithm == Algorithm::FixedWindow {
            assert_eq!(denied.retry_after(), Some(Duration::from_secs(3_600)));
            assert_eq!(second.reset_after(), Duration::from_secs(3_600));
        } else {
            // February weighs January's 2 by its unelapsed fraction: one more fits once
            // 2·(1 − x) ≤ 1, half of February (14 days) in.
            assert_eq!(
                denied.retry_after(),
                Some(Duration::from_secs(3_600 + 14 * 86_400))
            );
        }
        limiter
            .clock()
            .advance(Duration::from_secs(3_600) - Duration::from_nanos(1));
        assert!(
            !limiter.check(&1).is_allowed(),
            "{algorithm}: 1ns before the month"
        );
        limiter.clock().advance(Duration::from_nanos(1));
        assert_eq!(
            limiter.check(&1).is_allowed(),
            algorithm == Algorithm::FixedWindow
        );
    }
}

/// Per-key calendar quotas on a rolling limiter, and the conversion of a key's count
/// when its quota becomes a calendar one.
#[test]
fn keys_can_have_calendar_quotas_of_their_own() {
    let limiter = limiter("100/h", Algorithm::FixedWindow, JAN_31_23H);
    limiter.check_n(&7, 3).unwrap();
    limiter
        .set_quota(&7, "4/day calendar".parse().unwrap())
        .unwrap();
    // The 3 used carry over into the day, which ends in an hour.
    assert!(limiter.check(&7).is_allowed());
    let denied = limiter.check(&7);
    assert_eq!(denied.retry_after(), Some(Duration::from_secs(3_600)));
    assert!(
        limiter.check(&8).is_allowed(),
        "other keys keep the default"
    );
    assert_eq!(limiter.quota_for(&7), "4/day calendar".parse().unwrap());
}

#[cfg(feature = "calendar")]
#[test]
fn a_day_in_paris_lasts_23_hours_in_spring() {
    // 2025-03-30T12:00Z, the day Paris moves from 02:00 to 03:00.
    let limiter = limiter(
        "1/day calendar tz Europe/Paris",
        Algorithm::FixedWindow,
        1_743_336_000,
    );
    assert!(limiter.check(&1).is_allowed());
    let denied = limiter.check(&1);
    // The day ends at 2025-03-30T22:00Z (midnight at +02:00): 10 hours.
    assert_eq!(denied.retry_after(), Some(Duration::from_secs(10 * 3_600)));
    let quota: Quota = "1000/day calendar tz Europe/Paris".parse().unwrap();
    assert_eq!(quota.to_string(), "1000/day calendar tz Europe/Paris");
    let anchored: Quota = "50000/month calendar tz America/New_York anchor 15"
        .parse()
        .unwrap();
    assert_eq!(
        anchored.to_string(),
        "50000/month calendar tz America/New_York anchor 15"
    );
}

/// The zones the model runs in: with the `calendar` feature, zones with DST, a
/// midnight that does not happen (São Paulo 2018), a midnight that happens twice
/// (Havana), a half-hour DST (Lord Howe) and a skipped day (Apia 2011).
fn zones() -> &'static [&'static str] {
    if cfg!(feature = "calendar") {
        &[
            "UTC",
            "Europe/Paris",
            "America/Sao_Paulo",
            "America/Havana",
            "Australia/Lord_Howe",
            "Pacific/Apia",
        ]
    } else {
        &["UTC"]
    }
}

/// The reference: one count per period, keyed by the period's bounds and nothing else.
#[derive(Clone, Copy, Default)]
struct Model {
    /// (start, end, count) of the last period counted in, and the count of the one
    /// before it if it ended where that one starts.
    last: Option<(u64, u64, u64)>,
    before: u64,
}

impl Model {
    /// `(prev, cur, start, end)` at the wall instant `wall` (ns).
    fn view(&self, period: CalendarPeriod, wall: u64) -> (u64, u64, u64, u64) {
        let (start, end) = period.bounds_at(Duration::from_nanos(wall));
        let (start, end) = (start.as_nanos() as u64, end.as_nanos() as u64);
        match self.last {
            Some((s, _, count)) if s == start => (self.before, count, start, end),
            Some((_, e, count)) if e == start => (count, 0, start, end),
            _ => (0, 0, start, end),
        }
    }

    /// Whether a unit request passes at `wall`.
    fn admits(&self, period: CalendarPeriod, algorithm: Algorithm, limit: u64, wall: u64) -> bool {
        let (prev, cur, start, end) = self.view(period, wall);
        match algorithm {
            Algorithm::FixedWindow => cur < limit,
            _ => {
                let (len, left) = (u128::from(end - start), u128::from(end - wall));
                u128::from(prev) * left + u128::from(cur + 1) * len <= u128::from(limit) * len
            }
        }
    }

    fn admit(&mut self, period: CalendarPeriod, wall: u64) {
        let (prev, cur, start, end) = self.view(period, wall);
        self.before = prev;
        self.last = Some((start, end, cur + 1));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Random timelines from 2010 to 2040 with steps from a millisecond to forty days,
    /// every unit, anchor and zone: each decision is the model's; each deny's retry is
    /// exact (the model denies 1 ns before it and admits at it); each admission's reset
    /// is at or after the period's end.
    #[test]
    fn decisions_are_the_models(
        algorithm in prop_oneof![Just(Algorithm::FixedWindow), Just(Algorithm::SlidingWindow)],
        unit in 0usize..4,
        anchor in 1u8..=31,
        zone in any::<prop::sample::Index>(),
        limit in 1u64..4,
        start in 1_262_304_000u64..2_208_988_800,
        steps in prop::collection::vec((0u64..4, 1u64..1_000), 1..250),
    ) {
        let unit = [CalendarUnit::Day, CalendarUnit::Week, CalendarUnit::Month, CalendarUnit::Year][unit];
        let mut period = CalendarPeriod::utc(unit).tz(zone.get::<&str>(zones())).unwrap();
        if unit == CalendarUnit::Month {
            period = period.anchor(anchor).unwrap();
        }
        let quota = Quota::per_calendar(limit, period).unwrap();
        let clock = ManualClock::at_unix(Duration::from_secs(start));
        let limiter: RateLimiter<u64, ManualClock> =
            RateLimiter::builder(quota).algorithm(algorithm).clock(clock.clone()).build().unwrap();
        let mut model = Model::default();
        for (scale, amount) in steps {
            // A millisecond, a minute, an hour or a day, times 1 to 999 (a day's steps
            // are capped at 40 days).
            let step = match scale {
                0 => amount * 1_000_000,
                1 => amount * 60 * SEC,
                2 => amount * 3_600 * SEC,
                _ => (amount % 40 + 1) * 86_400 * SEC,
            };
            clock.advance(Duration::from_nanos(step));
            let wall = start * SEC + clock.elapsed().as_nanos() as u64;
            let expected = model.admits(period, algorithm, limit, wall);
            let decision: Decision = limiter.check(&1);
            prop_assert_eq!(decision.is_allowed(), expected, "at {} ns", wall);
            let (_, _, _, end) = model.view(period, wall);
            if expected {
                model.admit(period, wall);
                prop_assert!(decision.reset_after().as_nanos() as u64 >= end - wall);
            } else {
                let retry = decision.retry_after().unwrap().as_nanos() as u64;
                prop_assert!(retry > 0);
                prop_assert!(!model.admits(period, algorithm, limit, wall + retry - 1), "retry {} too early", retry);
                prop_assert!(model.admits(period, algorithm, limit, wall + retry), "retry {} too late", retry);
                if algorithm == Algorithm::FixedWindow {
                    prop_assert_eq!(retry, end - wall);
                }
            }
        }
    }
}
