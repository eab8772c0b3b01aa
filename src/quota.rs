//! What a limit is: `limit` requests per `period`, with an optional burst.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::calendar::{CalendarPeriod, CalendarUnit};
use crate::error::ConfigError;

const NANOS_PER_SEC: u64 = 1_000_000_000;

/// The largest relative error, as a fraction `1 / MAX_RATE_ERROR_INVERSE`, that truncating
/// `period / limit` to whole nanoseconds may introduce.
const MAX_RATE_ERROR_INVERSE: u128 = 10_000;

/// Period units accepted in quota strings, largest first, as (suffixes, nanoseconds).
/// The first suffix of each row is the one [`Quota`]'s `Display` writes.
const UNITS: &[(&[&str], u64)] = &[
    (&["d", "day", "days"], 86_400 * NANOS_PER_SEC),
    // After the day, so that `Display` writes `7d`.
    (&["w", "week", "weeks"], 7 * 86_400 * NANOS_PER_SEC),
    (&["h", "hr", "hour", "hours"], 3_600 * NANOS_PER_SEC),
    (&["min", "m", "minute", "minutes"], 60 * NANOS_PER_SEC),
    (&["s", "sec", "second", "seconds"], NANOS_PER_SEC),
    (&["ms", "millisecond", "milliseconds"], 1_000_000),
    (&["us", "µs", "microsecond", "microseconds"], 1_000),
    (&["ns", "nanosecond", "nanoseconds"], 1),
];

/// A rate limit: `limit` requests per `period`, with a burst that defaults to `limit`.
///
/// The period is rolling (any interval of its length), or a calendar period
/// ([`per_calendar`](Self::per_calendar), `"10000/month calendar"`): days, ISO weeks,
/// months or years in UTC or a time zone, for the window algorithms.
///
/// A `Quota` is validated when it is built, so every `Quota` value can be used by the
/// token bucket. The emission interval `T = ⌊period / limit⌋` must be a whole number of
/// nanoseconds that changes the rate by at most one part in 10,000; `burst × T` must fit
/// in 64-bit nanoseconds.
///
/// ```
/// use std::time::Duration;
/// use tollgate::Quota;
///
/// let q = Quota::per_second(100)?.with_burst(200)?;
/// assert_eq!((q.limit(), q.period(), q.burst()), (100, Duration::from_secs(1), 200));
/// assert_eq!("100/s burst 200".parse::<Quota>()?, q);
/// assert_eq!(q.to_string(), "100/s burst 200");
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Quota {
    limit: u64,
    period_ns: u64,
    burst: u64,
    calendar: Option<CalendarPeriod>,
}

impl Quota {
    /// `limit` requests per second.
    ///
    /// # Errors
    /// See [`Quota::new`].
    pub fn per_second(limit: u64) -> Result<Self, ConfigError> {
        Self::new(limit, Duration::from_secs(1))
    }

    /// `limit` requests per minute.
    ///
    /// # Errors
    /// See [`Quota::new`].
    pub fn per_minute(limit: u64) -> Result<Self, ConfigError> {
        Self::new(limit, Duration::from_secs(60))
    }

    /// `limit` requests per hour.
    ///
    /// # Errors
    /// See [`Quota::new`].
    pub fn per_hour(limit: u64) -> Result<Self, ConfigError> {
        Self::new(limit, Duration::from_secs(3600))
    }

    /// `limit` requests per `period`, with a burst of `limit`.
    ///
    /// # Errors
    /// [`ConfigError::ZeroLimit`], [`ConfigError::ZeroPeriod`],
    /// [`ConfigError::PeriodTooLong`] or [`ConfigError::RateNotRepresentable`].
    pub fn new(limit: u64, period: Duration) -> Result<Self, ConfigError> {
        if limit == 0 {
            return Err(ConfigError::ZeroLimit);
        }
        if period.is_zero() {
            return Err(ConfigError::ZeroPeriod);
        }
        let period_ns = u64::try_from(period.as_nanos()).map_err(|_| ConfigError::PeriodTooLong)?;
        let interval = period_ns / limit;
        let lost = u128::from(period_ns % limit);
        // Truncating T over-admits by lost / (limit · T); allow at most 1 / 10,000.
        if interval == 0 || lost * MAX_RATE_ERROR_INVERSE > u128::from(limit) * u128::from(interval)
        {
            return Err(ConfigError::RateNotRepresentable { limit, period_ns });
        }
        Ok(Self {
            limit,
            period_ns,
            burst: limit,
            calendar: None,
        })
    }

    /// `limit` requests per calendar period: windows from one period's start to the
    /// next (a day from local midnight, a month from its anchor day), whatever their
    /// length. The fixed window and the sliding window counter run on them; the other
    /// algorithms refuse them ([`ConfigError::CalendarUnsupported`]).
    /// [`period`](Self::period) is the unit's nominal length.
    ///
    /// ```
    /// use tollgate::{calendar::CalendarPeriod, Quota};
    ///
    /// let q = Quota::per_calendar(10_000, CalendarPeriod::month().anchor(15)?)?;
    /// assert_eq!(q, "10000/month calendar anchor 15".parse()?);
    /// assert_eq!(q.to_string(), "10000/month calendar anchor 15");
    /// # Ok::<(), tollgate::ConfigError>(())
    /// ```
    ///
    /// # Errors
    /// [`ConfigError::ZeroLimit`], or [`ConfigError::RateNotRepresentable`] for a limit
    /// above the nominal period in nanoseconds.
    pub fn per_calendar(limit: u64, period: CalendarPeriod) -> Result<Self, ConfigError> {
        let quota = Self::new(limit, period.unit().nominal())?;
        Ok(Self {
            calendar: Some(period),
            ..quota
        })
    }

    /// The calendar period, if the quota has one rather than a rolling period.
    pub fn calendar(&self) -> Option<CalendarPeriod> {
        self.calendar
    }

    /// The same rate with a different burst: how many requests may pass at once after a
    /// quiet spell (the token bucket's capacity).
    ///
    /// # Errors
    /// [`ConfigError::ZeroBurst`], or [`ConfigError::BurstTooLarge`] when
    /// `burst × period / limit` does not fit in 64-bit nanoseconds.
    pub fn with_burst(self, burst: u64) -> Result<Self, ConfigError> {
        if burst == 0 {
            return Err(ConfigError::ZeroBurst);
        }
        let max = u64::MAX / self.emission_interval_ns();
        if burst > max {
            return Err(ConfigError::BurstTooLarge { burst, max });
        }
        Ok(Self { burst, ..self })
    }

    /// How many requests one period admits.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The period the limit applies to.
    pub fn period(&self) -> Duration {
        Duration::from_nanos(self.period_ns)
    }

    /// How many requests may pass at once; defaults to [`limit`](Self::limit).
    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// `T = ⌊period / limit⌋`: the spacing of requests at the sustained rate, truncated to
    /// whole nanoseconds (the truncation changes the rate by at most 0.01%).
    pub fn emission_interval(&self) -> Duration {
        Duration::from_nanos(self.emission_interval_ns())
    }

    /// The period in nanoseconds.
    pub(crate) fn period_ns(&self) -> u64 {
        self.period_ns
    }

    /// `T = ⌊period / limit⌋`, the spacing of requests at the sustained rate, in
    /// nanoseconds. Never zero.
    pub(crate) fn emission_interval_ns(&self) -> u64 {
        self.period_ns / self.limit
    }
}

impl fmt::Display for Quota {
    /// Writes the quota in the syntax [`FromStr`] reads, e.g. `100/s`, `10/30s burst 20`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(calendar) = self.calendar {
            write!(f, "{}/{calendar}", self.limit)?;
            if self.burst != self.limit {
                write!(f, " burst {}", self.burst)?;
            }
            return Ok(());
        }
        let (suffixes, unit_ns) = UNITS
            .iter()
            .find(|(_, ns)| self.period_ns % ns == 0)
            .expect("the nanosecond unit divides every period");
        let count = self.period_ns / unit_ns;
        write!(f, "{}/", self.limit)?;
        if count != 1 {
            write!(f, "{count}")?;
        }
        f.write_str(suffixes[0])?;
        if self.burst != self.limit {
            write!(f, " burst {}", self.burst)?;
        }
        Ok(())
    }
}

impl FromStr for Quota {
    type Err = ConfigError;

    /// Parses `<limit>/<period>[ burst <n>]`, where the period is an optional whole number
    /// followed by a unit: `ns`, `us`, `ms`, `s`, `min` (or `m`), `h`, `d` or `w`.
    /// Examples: `"100/s"`, `"600/min"`, `"5000/h"`, `"100/30s"`, `"10/s burst 20"`.
    ///
    /// A calendar period is `day`, `week`, `month` or `year` followed by `calendar`, then
    /// optionally `tz <IANA zone>` and, for months, `anchor <day>`:
    /// `"1000/day calendar"`, `"1000/day calendar tz Europe/Paris"`,
    /// `"10000/month calendar anchor 15"`. A month or a year with no `calendar` is an
    /// error (they have no one length); `"1000/day"` is a rolling 24 hours.
    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let fail = |reason: String| ConfigError::InvalidQuotaString {
            input: input.to_owned(),
            reason,
        };
        let (limit_part, rest) = input.split_once('/').ok_or_else(|| {
            fail("missing '/' between the limit and the period, as in \"100/s\"".into())
        })?;
        let limit = parse_count(limit_part.trim(), "limit").map_err(fail)?;

        let mut words = rest.split_whitespace();
        let period_word = words
            .next()
            .ok_or_else(|| fail("missing the period after '/', as in \"100/s\"".into()))?;
        let options = Options::parse(words).map_err(fail)?;
        let quota = if options.calendar {
            let period = calendar_period(period_word, &options).map_err(fail)?;
            Quota::per_calendar(limit, period)?
        } else {
            if options.tz.is_some() || options.anchor.is_some() {
                return Err(fail(
                    "\"tz\" and \"anchor\" apply to calendar periods: write them after \
                     \"calendar\", as in \"1000/day calendar tz Europe/Paris\""
                        .into(),
                ));
            }
            if matches!(
                period_word.trim_start_matches(|c: char| c.is_ascii_digit()),
                "month" | "months" | "year" | "years"
            ) {
                return Err(fail(format!(
                    "a {period_word:?} has no one length: write \"{limit}/{} calendar\" for \
                     calendar periods, or a rolling period in days such as \"{limit}/30d\"",
                    period_word
                        .trim_start_matches(|c: char| c.is_ascii_digit())
                        .trim_end_matches('s')
                )));
            }
            let period_ns = parse_period(period_word).map_err(fail)?;
            Quota::new(limit, Duration::from_nanos(period_ns))?
        };
        match options.burst {
            Some(b) => quota.with_burst(b),
            None => Ok(quota),
        }
    }
}

/// What may follow a quota string's period, in any order, each once.
#[derive(Default)]
struct Options<'a> {
    burst: Option<u64>,
    calendar: bool,
    tz: Option<&'a str>,
    anchor: Option<u64>,
}

impl<'a> Options<'a> {
    fn parse(mut words: impl Iterator<Item = &'a str>) -> Result<Self, String> {
        let mut options = Options::default();
        let mut last = None;
        while let Some(word) = words.next() {
            let mut value = |what: &str| {
                words
                    .next()
                    .ok_or_else(|| format!("'{word}' must be followed by {what}"))
            };
            let repeated = match word {
                "burst" => options
                    .burst
                    .replace(parse_count(value("a number")?, "burst")?)
                    .is_some(),
                "calendar" => std::mem::replace(&mut options.calendar, true),
                "tz" => options
                    .tz
                    .replace(value("a time zone name, as in \"tz Europe/Paris\"")?)
                    .is_some(),
                "anchor" => options
                    .anchor
                    .replace(parse_count(value("a day of the month")?, "anchor day")?)
                    .is_some(),
                _ if last == Some("burst") => {
                    return Err("unexpected text after the burst: write \"burst <n>\" last".into());
                }
                _ => {
                    return Err(format!(
                        "unexpected {word:?} after the period: only \"burst <n>\", \
                         \"calendar\", \"tz <zone>\" and \"anchor <day>\" may follow"
                    ));
                }
            };
            if repeated {
                return Err(format!("{word:?} is given twice"));
            }
            last = Some(word);
        }
        Ok(options)
    }
}

/// The calendar period of a quota string's period word and options.
fn calendar_period(word: &str, options: &Options<'_>) -> Result<CalendarPeriod, String> {
    let unit = CalendarUnit::from_word(word).ok_or_else(|| {
        format!(
            "a calendar period is one day, week, month or year, not {word:?}: write \
             \"1000/day calendar\" or \"10000/month calendar\""
        )
    })?;
    let mut period = CalendarPeriod::utc(unit);
    if let Some(zone) = options.tz {
        period = period.tz(zone).map_err(|e| e.to_string())?;
    }
    if let Some(day) = options.anchor {
        let day = u8::try_from(day).unwrap_or(u8::MAX);
        period = period.anchor(day).map_err(|e| e.to_string())?;
    }
    Ok(period)
}

/// Parses a whole, non-negative number, naming `what` in the error.
fn parse_count(text: &str, what: &str) -> Result<u64, String> {
    if text.is_empty() {
        return Err(format!("the {what} is missing"));
    }
    text.parse::<u64>()
        .map_err(|_| format!("the {what} {text:?} is not a whole number"))
}

/// Parses `[count]unit` into nanoseconds.
pub(crate) fn parse_period(word: &str) -> Result<u64, String> {
    let digits = word
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(word.len());
    let (count_text, unit) = word.split_at(digits);
    let count = if count_text.is_empty() {
        1
    } else {
        parse_count(count_text, "period count")?
    };
    let unit_ns = UNITS
        .iter()
        .find(|(suffixes, _)| suffixes.contains(&unit))
        .map(|(_, ns)| *ns)
        .ok_or_else(|| format!("unknown period unit {unit:?}: use ns, us, ms, s, min, h or d"))?;
    count
        .checked_mul(unit_ns)
        .ok_or_else(|| format!("the period {word:?} is longer than ~584 years"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_documented_strings() {
        let q = |s: &str| s.parse::<Quota>().unwrap();
        assert_eq!(q("100/s"), Quota::per_second(100).unwrap());
        assert_eq!(q("600/min"), Quota::per_minute(600).unwrap());
        assert_eq!(q("5000/h"), Quota::per_hour(5000).unwrap());
        assert_eq!(
            q("100/30s"),
            Quota::new(100, Duration::from_secs(30)).unwrap()
        );
        assert_eq!(
            q("10/s burst 20"),
            Quota::per_second(10).unwrap().with_burst(20).unwrap()
        );
        assert_eq!(
            q("  7 / 250ms  "),
            Quota::new(7, Duration::from_millis(250)).unwrap()
        );
    }

    #[test]
    fn truncation_error_rule() {
        // 3/s truncates T to 333_333_333ns: an error of 1e-9, accepted.
        assert_eq!(
            Quota::per_second(3).unwrap().emission_interval_ns(),
            333_333_333
        );
        // 6e8/s would need T = 1.67ns: refused.
        assert!(matches!(
            Quota::per_second(600_000_000),
            Err(ConfigError::RateNotRepresentable { .. })
        ));
        assert!(Quota::per_second(1_000_000_000).is_ok());
    }
}
