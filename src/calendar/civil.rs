//! The proleptic Gregorian calendar as integer arithmetic on day numbers: day 0 is
//! 1970-01-01. Pure functions, no time zone.

/// Days in 400 Gregorian years: the calendar's full cycle.
const DAYS_PER_ERA: i64 = 146_097;
/// Day number of 0000-03-01, the first day of the era arithmetic below (years start on
/// March 1st there, so that the leap day is the last day of a year).
const MARCH_ZERO: i64 = 719_468;

/// A civil date.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Ymd {
    pub(crate) year: i64,
    /// 1 to 12.
    pub(crate) month: u8,
    /// 1 to 31.
    pub(crate) day: u8,
}

/// The day number of a civil date (which must exist).
pub(crate) fn days_from_civil(date: Ymd) -> i64 {
    // Count years from March, so February (and its leap day) ends the year.
    let year = date.year - i64::from(date.month <= 2);
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let month_from_march = (i64::from(date.month) + 9) % 12;
    let day_of_year = (153 * month_from_march + 2) / 5 + i64::from(date.day) - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * DAYS_PER_ERA + day_of_era - MARCH_ZERO
}

/// The civil date of a day number.
pub(crate) fn civil_from_days(days: i64) -> Ymd {
    let shifted = days + MARCH_ZERO;
    let era = shifted.div_euclid(DAYS_PER_ERA);
    let day_of_era = shifted - era * DAYS_PER_ERA;
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    Ymd {
        year: year_of_era + era * 400 + i64::from(month <= 2),
        month: month as u8,
        day: day as u8,
    }
}

/// Whether `year` has a February 29th.
pub(crate) fn is_leap(year: i64) -> bool {
    year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)
}

/// Days in `month` (1 to 12) of `year`.
pub(crate) fn days_in_month(year: i64, month: u8) -> u8 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// The ISO weekday of a day number, Monday 0 to Sunday 6 (day 0 was a Thursday).
pub(crate) fn weekday_from_monday(days: i64) -> i64 {
    (days + 3).rem_euclid(7)
}

#[cfg(all(test, not(tollgate_loom)))]
mod tests {
    use super::*;

    #[test]
    fn known_dates() {
        let d = |year, month, day| Ymd { year, month, day };
        assert_eq!(days_from_civil(d(1970, 1, 1)), 0);
        assert_eq!(days_from_civil(d(2000, 3, 1)), 11_017);
        assert_eq!(days_from_civil(d(2024, 2, 29)), 19_782);
        assert_eq!(days_from_civil(d(1969, 12, 31)), -1);
        assert_eq!(civil_from_days(19_782), d(2024, 2, 29));
        assert_eq!(weekday_from_monday(0), 3); // a Thursday
        assert_eq!(weekday_from_monday(days_from_civil(d(2026, 12, 7))), 0); // a Monday
    }

    /// Every day of 800 years around the epoch round-trips, and consecutive day
    /// numbers are consecutive dates.
    #[test]
    fn every_day_round_trips_in_order() {
        let mut previous = civil_from_days(-146_097 - 1);
        for days in -146_097..146_097 {
            let date = civil_from_days(days);
            assert_eq!(days_from_civil(date), days);
            let next_of_previous = if previous.day < days_in_month(previous.year, previous.month) {
                Ymd {
                    day: previous.day + 1,
                    ..previous
                }
            } else if previous.month < 12 {
                Ymd {
                    year: previous.year,
                    month: previous.month + 1,
                    day: 1,
                }
            } else {
                Ymd {
                    year: previous.year + 1,
                    month: 1,
                    day: 1,
                }
            };
            assert_eq!(date, next_of_previous, "day {days}");
            previous = date;
        }
    }
}
