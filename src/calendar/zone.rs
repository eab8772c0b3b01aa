//! Where a calendar's days begin: UTC, or an IANA time zone through `jiff` (cargo feature
//! `calendar`) and its bundled database, so every machine reads the same rules.

#[cfg(feature = "calendar")]
use super::civil::{self, Ymd};
use crate::error::ConfigError;

const SECONDS_PER_DAY: i64 = 86_400;

/// A time zone's rules.
pub(crate) enum Zone {
    Utc,
    #[cfg(feature = "calendar")]
    Named(jiff::tz::TimeZone),
}

impl Zone {
    /// The zone named `name`: `UTC`, or (with the `calendar` feature) an IANA name.
    ///
    /// # Errors
    /// [`ConfigError::UnknownTimeZone`] for a name the bundled database lacks, or any
    /// name but `UTC` without the `calendar` feature.
    pub(crate) fn find(name: &str) -> Result<(Zone, Box<str>), ConfigError> {
        if name == "UTC" {
            return Ok((Zone::Utc, name.into()));
        }
        #[cfg(feature = "calendar")]
        {
            let unknown = || ConfigError::UnknownTimeZone {
                zone: name.to_owned(),
                why: "not in the bundled IANA time zone database (names look like \
                      \"Europe/Paris\" or \"America/New_York\")",
            };
            let zone = jiff::tz::db().get(name).map_err(|_| unknown())?;
            // The database's own spelling, so that two spellings are one calendar.
            let canonical = zone.iana_name().unwrap_or(name).into();
            Ok((Zone::Named(zone), canonical))
        }
        #[cfg(not(feature = "calendar"))]
        Err(ConfigError::UnknownTimeZone {
            zone: name.to_owned(),
            why: "time zones other than UTC need tollgate's cargo feature `calendar`",
        })
    }

    /// The local day number (0 is 1970-01-01) of the instant `unix_s`.
    pub(crate) fn local_day(&self, unix_s: i64) -> i64 {
        (unix_s + self.offset_at(unix_s)).div_euclid(SECONDS_PER_DAY)
    }

    /// Seconds the zone's clocks are ahead of UTC at the instant `unix_s`.
    fn offset_at(&self, unix_s: i64) -> i64 {
        match self {
            Zone::Utc => {
                let _utc_at_every_instant = unix_s;
                0
            }
            #[cfg(feature = "calendar")]
            Zone::Named(zone) => jiff::Timestamp::from_second(unix_s)
                .map_or(0, |t| i64::from(zone.to_offset(t).seconds())),
        }
    }

    /// The first instant (Unix seconds) of local day `days`: its midnight, or where
    /// midnight falls in a gap (a clock set forward at 00:00), the end of the gap; where
    /// midnight happens twice, the first.
    pub(crate) fn day_start(&self, days: i64) -> i64 {
        let utc = days * SECONDS_PER_DAY;
        match self {
            Zone::Utc => utc,
            #[cfg(feature = "calendar")]
            Zone::Named(zone) => {
                let Ymd { year, month, day } = civil::civil_from_days(days);
                let start = i16::try_from(year)
                    .ok()
                    .and_then(|y| jiff::civil::Date::new(y, month as i8, day as i8).ok())
                    .and_then(|date| zone.to_timestamp(jiff::civil::DateTime::from(date)).ok());
                // Outside jiff's years (±9999), which no clock reaches: UTC's midnight.
                start.map_or(utc, jiff::Timestamp::as_second)
            }
        }
    }
}
