//! Calendar periods: windows aligned to days, ISO weeks, months and years in UTC or an
//! IANA time zone, for quotas such as `"10000/month calendar"` or
//! `"1000/day calendar tz Europe/Paris"`.
//!
//! A calendar period is a [`CalendarPeriod`], part of a [`Quota`](crate::Quota). The
//! fixed window and the sliding window counter run on it: their windows are then the
//! calendar's periods, which need not be of one length (a day in a zone with daylight
//! saving time lasts 23, 24 or 25 hours; a month 28 to 31 days), and a decision's
//! `reset_after` and `retry_after` count to the period's real end.
//!
//! Wall time comes from the limiter's clock: [`Clock::unix_origin_ns`](crate::clock::Clock::unix_origin_ns)
//! is the Unix instant of its origin, read once when the limiter is built.
//!
//! **Cost.** The periods' boundaries are computed once per period (through `jiff` for a
//! named zone) and cached in the calendar, shared by every limiter that uses it, behind a
//! sequence lock that readers never wait on: a check reads five words and compares two,
//! about what a rolling window's division costs.

mod civil;
mod span;
mod zone;

use std::fmt;
use std::sync::OnceLock;
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::ConfigError;
pub(crate) use span::Span;
use span::SpanCache;
use zone::Zone;

/// A calendar unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CalendarUnit {
    /// From one local midnight to the next.
    Day,
    /// An ISO week: from Monday's local midnight to the next Monday's.
    Week,
    /// From the anchor day's local midnight to the next month's (the 1st by default).
    Month,
    /// From January 1st's local midnight to the next year's.
    Year,
}

impl CalendarUnit {
    /// The unit's name in quota strings: `day`, `week`, `month` or `year`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Day => "day",
            Self::Week => "week",
            Self::Month => "month",
            Self::Year => "year",
        }
    }

    /// The unit's nominal length: 1 day, 7 days, and the Gregorian calendar's mean month
    /// (30.436875 days) and year (365.2425 days). A quota's
    /// [`period`](crate::Quota::period) reports it, for what reads one length (the
    /// `RateLimit-Policy` header's `w`); windows use the real periods.
    pub fn nominal(&self) -> Duration {
        Duration::from_secs(match self {
            Self::Day => 86_400,
            Self::Week => 7 * 86_400,
            Self::Month => 2_629_746,
            Self::Year => 31_556_952,
        })
    }

    /// The unit a quota string's period word names, if it is one.
    pub(crate) fn from_word(word: &str) -> Option<Self> {
        Some(match word {
            "day" | "d" => Self::Day,
            "week" | "w" => Self::Week,
            "month" => Self::Month,
            "year" => Self::Year,
            _ => return None,
        })
    }
}

/// A calendar period: a unit, a time zone and, for months, an anchor day. `Copy`, and
/// compared by what it describes.
///
/// ```
/// use std::time::Duration;
/// use tollgate::calendar::CalendarPeriod;
///
/// // Months from the 31st: February's starts on its last day.
/// let billing = CalendarPeriod::month().anchor(31)?;
/// let feb_10_2025 = Duration::from_secs(1_739_145_600);
/// let (start, end) = billing.bounds_at(feb_10_2025);
/// assert_eq!(start, Duration::from_secs(1_738_281_600)); // 2025-01-31T00:00Z
/// assert_eq!(end, Duration::from_secs(1_740_700_800)); // 2025-02-28T00:00Z
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
#[derive(Clone, Copy)]
pub struct CalendarPeriod(&'static Calendar);

impl CalendarPeriod {
    /// Days in UTC.
    pub fn day() -> Self {
        Self::utc(CalendarUnit::Day)
    }

    /// ISO weeks (from Monday) in UTC.
    pub fn week() -> Self {
        Self::utc(CalendarUnit::Week)
    }

    /// Months from the 1st, in UTC.
    pub fn month() -> Self {
        Self::utc(CalendarUnit::Month)
    }

    /// Years from January 1st, in UTC.
    pub fn year() -> Self {
        Self::utc(CalendarUnit::Year)
    }

    /// Periods of `unit` in UTC.
    pub fn utc(unit: CalendarUnit) -> Self {
        Self::intern(unit, "UTC", 1).expect("UTC is always known")
    }

    /// The same periods with their days beginning at local midnight in the IANA zone
    /// `name` (`"UTC"`, or with the cargo feature `calendar`, any zone of the bundled
    /// database, such as `"Europe/Paris"`).
    ///
    /// # Errors
    /// [`ConfigError::UnknownTimeZone`].
    pub fn tz(self, name: &str) -> Result<Self, ConfigError> {
        Self::intern(self.0.unit, name, self.0.anchor)
    }

    /// Months that begin on day `day` (1 to 31) of each month, the customer's billing
    /// day; in a shorter month, on its last day (the 31st means February's 28th or 29th).
    ///
    /// # Errors
    /// [`ConfigError::InvalidAnchor`] for a day outside 1 to 31, or a unit other than
    /// the month.
    pub fn anchor(self, day: u8) -> Result<Self, ConfigError> {
        if self.0.unit != CalendarUnit::Month || !(1..=31).contains(&day) {
            return Err(ConfigError::InvalidAnchor {
                unit: self.0.unit.name(),
                day: u64::from(day),
            });
        }
        Self::intern(self.0.unit, &self.0.zone_name, day)
    }

    /// The unit.
    pub fn unit(&self) -> CalendarUnit {
        self.0.unit
    }

    /// The time zone's name: `UTC` or an IANA name.
    pub fn zone(&self) -> &str {
        &self.0.zone_name
    }

    /// The day months begin on (1 unless [`anchor`](Self::anchor) set another).
    pub fn anchor_day(&self) -> u8 {
        self.0.anchor
    }

    /// The start and end (exclusive) of the period holding the Unix instant `unix`, as
    /// Unix instants.
    pub fn bounds_at(&self, unix: Duration) -> (Duration, Duration) {
        let wall = crate::clock::nanos(unix);
        let span = self.0.span_at(wall);
        (
            Duration::from_nanos(span.start),
            Duration::from_nanos(span.end),
        )
    }

    /// The period holding the Unix instant `wall_ns`, with its successor's end.
    #[inline]
    pub(crate) fn span_at(&self, wall_ns: u64) -> Span {
        self.0.span_at(wall_ns)
    }

    /// The start (Unix nanoseconds) of the period of index `index`.
    pub(crate) fn start_of(&self, index: u64) -> u64 {
        self.0.start_of(index)
    }

    /// The one calendar of this description, made on first use.
    fn intern(unit: CalendarUnit, zone: &str, anchor: u8) -> Result<Self, ConfigError> {
        static ALL: OnceLock<Mutex<Vec<&'static Calendar>>> = OnceLock::new();
        let all = ALL.get_or_init(|| Mutex::new(Vec::new()));
        let find = |all: &[&'static Calendar], zone: &str| {
            all.iter()
                .find(|c| c.unit == unit && c.anchor == anchor && &*c.zone_name == zone)
                .copied()
        };
        if let Some(known) = find(&all.lock(), zone) {
            return Ok(Self(known));
        }
        let (rules, zone_name) = Zone::find(zone)?;
        let mut all = all.lock();
        if let Some(known) = find(&all, &zone_name) {
            return Ok(Self(known));
        }
        // One per description ever used (units × zones × anchors): a bounded set, kept
        // for the process's life so that quotas stay `Copy`.
        let calendar: &'static Calendar = Box::leak(Box::new(Calendar {
            unit,
            anchor,
            zone_name,
            zone: rules,
            cache: SpanCache::default(),
        }));
        all.push(calendar);
        Ok(Self(calendar))
    }
}

impl PartialEq for CalendarPeriod {
    fn eq(&self, other: &Self) -> bool {
        // Interned: one calendar per description.
        std::ptr::eq(self.0, other.0)
    }
}

impl Eq for CalendarPeriod {}

impl std::hash::Hash for CalendarPeriod {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (self.0.unit, self.0.anchor, &*self.0.zone_name).hash(state);
    }
}

impl fmt::Debug for CalendarPeriod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CalendarPeriod({self})")
    }
}

impl fmt::Display for CalendarPeriod {
    /// `month calendar tz Europe/Paris anchor 15`: what follows the `/` in a quota string.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} calendar", self.0.unit.name())?;
        if &*self.0.zone_name != "UTC" {
            write!(f, " tz {}", self.0.zone_name)?;
        }
        if self.0.anchor != 1 {
            write!(f, " anchor {}", self.0.anchor)?;
        }
        Ok(())
    }
}

/// A calendar's rules and the cache of its current period.
struct Calendar {
    unit: CalendarUnit,
    /// The month's first day (1 for the other units).
    anchor: u8,
    zone_name: Box<str>,
    zone: Zone,
    cache: SpanCache,
}

/// Indexes of days and weeks are offset by this much, so that the days just before
/// 1970 in zones west of UTC have one too.
const INDEX_BIAS: i64 = 1 << 20;
/// The largest index the boundaries are computed for.
const MAX_INDEX: u64 = 1 << 32;
const NANOS_PER_SEC: i64 = 1_000_000_000;

impl Calendar {
    #[inline]
    fn span_at(&self, wall_ns: u64) -> Span {
        if let Some(span) = self.cache.get(wall_ns) {
            return span;
        }
        let span = self.compute(wall_ns);
        self.cache.put(span);
        span
    }

    /// The period holding `wall_ns`, from the zone's rules.
    fn compute(&self, wall_ns: u64) -> Span {
        let unix_s = (wall_ns / NANOS_PER_SEC as u64) as i64;
        let index = self.index_of_day(self.zone.local_day(unix_s));
        let start = self.start_of(index).min(wall_ns);
        // Only past 2554, where boundaries saturate, can the end fail to lie ahead.
        let end = self.start_of(index + 1).max(wall_ns.saturating_add(1));
        Span {
            index,
            start,
            end,
            next_end: self.start_of(index + 2).max(end),
        }
    }

    /// The index of the period holding local day `day`.
    fn index_of_day(&self, day: i64) -> u64 {
        let index = match self.unit {
            CalendarUnit::Day => day + INDEX_BIAS,
            CalendarUnit::Week => {
                let monday = day - civil::weekday_from_monday(day);
                (monday + 3).div_euclid(7) + INDEX_BIAS
            }
            CalendarUnit::Month => {
                let date = civil::civil_from_days(day);
                let month = date.year * 12 + i64::from(date.month) - 1;
                if date.day >= self.month_anchor(date.year, date.month) {
                    month
                } else {
                    month - 1
                }
            }
            CalendarUnit::Year => civil::civil_from_days(day).year,
        };
        u64::try_from(index).unwrap_or(0)
    }

    /// The first day of months of `year`'s `month`: the anchor, or the month's last day.
    fn month_anchor(&self, year: i64, month: u8) -> u8 {
        self.anchor.min(civil::days_in_month(year, month))
    }

    /// The start (Unix nanoseconds, 0 before 1970) of period `index`.
    fn start_of(&self, index: u64) -> u64 {
        // Far beyond any clock (a day index of 2^32 is 11 million years), so that the
        // arithmetic below cannot overflow.
        let index = i64::try_from(index.min(MAX_INDEX)).unwrap_or(0);
        let first_day = match self.unit {
            CalendarUnit::Day => index - INDEX_BIAS,
            CalendarUnit::Week => (index - INDEX_BIAS) * 7 - 3,
            CalendarUnit::Month => {
                let (year, month) = (index.div_euclid(12), (index.rem_euclid(12) + 1) as u8);
                civil::days_from_civil(civil::Ymd {
                    year,
                    month,
                    day: self.month_anchor(year, month),
                })
            }
            CalendarUnit::Year => civil::days_from_civil(civil::Ymd {
                year: index,
                month: 1,
                day: 1,
            }),
        };
        let seconds = self.zone.day_start(first_day).max(0);
        u64::try_from(seconds)
            .ok()
            .and_then(|s| s.checked_mul(NANOS_PER_SEC as u64))
            .unwrap_or(u64::MAX)
    }
}

#[cfg(all(test, not(tollgate_loom)))]
mod tests;
