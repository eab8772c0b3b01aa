//! Quotas: constructors, validation errors, and the string syntax.

use std::time::Duration;

use proptest::prelude::*;
use tollgate::{ConfigError, Quota};

#[test]
fn constructors_and_accessors() {
    let q = Quota::per_minute(600).unwrap();
    assert_eq!(
        (q.limit(), q.period(), q.burst()),
        (600, Duration::from_secs(60), 600)
    );
    assert_eq!(q.emission_interval(), Duration::from_millis(100));
    let q = Quota::per_hour(5000).unwrap().with_burst(10).unwrap();
    assert_eq!(
        (q.limit(), q.period(), q.burst()),
        (5000, Duration::from_secs(3600), 10)
    );
}

#[test]
fn every_bad_value_is_a_typed_error_with_a_fix() {
    let cases: Vec<(Result<Quota, ConfigError>, &str)> = vec![
        (Quota::per_second(0), "allow at least 1 request"),
        (Quota::new(5, Duration::ZERO), "at least 1ns"),
        (Quota::new(5, Duration::MAX), "shorten it"),
        (
            Quota::per_second(1).unwrap().with_burst(0),
            "burst of at least 1",
        ),
        (Quota::per_second(1_000_000_000_000), "lower the limit"),
        (
            Quota::per_second(1).unwrap().with_burst(u64::MAX),
            "at most 18446744073",
        ),
    ];
    for (result, fix) in cases {
        let err = result.unwrap_err();
        assert!(err.to_string().contains(fix), "{err} should say {fix:?}");
        let _: &dyn std::error::Error = &err;
    }
    assert!(matches!(Quota::per_second(0), Err(ConfigError::ZeroLimit)));
    assert!(matches!(
        Quota::new(1, Duration::ZERO),
        Err(ConfigError::ZeroPeriod)
    ));
    assert!(matches!(
        Quota::per_second(1).unwrap().with_burst(0),
        Err(ConfigError::ZeroBurst)
    ));
    assert!(matches!(
        Quota::per_second(1_000_000_000_000),
        Err(ConfigError::RateNotRepresentable {
            limit: 1_000_000_000_000,
            period_ns: 1_000_000_000
        })
    ));
}

#[test]
fn parses_the_documented_forms() {
    let parse = |s: &str| s.parse::<Quota>().unwrap();
    assert_eq!(parse("100/s"), Quota::per_second(100).unwrap());
    assert_eq!(parse("600/min"), Quota::per_minute(600).unwrap());
    assert_eq!(parse("5000/h"), Quota::per_hour(5000).unwrap());
    assert_eq!(
        parse("100/30s"),
        Quota::new(100, Duration::from_secs(30)).unwrap()
    );
    assert_eq!(
        parse("10/s burst 20"),
        Quota::per_second(10).unwrap().with_burst(20).unwrap()
    );
    assert_eq!(
        parse("1/d"),
        Quota::new(1, Duration::from_secs(86_400)).unwrap()
    );
}

#[test]
fn malformed_strings_say_which_part_is_wrong() {
    let cases = [
        ("", "missing '/'"),
        ("100", "missing '/'"),
        ("abc/s", "the limit \"abc\" is not a whole number"),
        ("-5/s", "the limit \"-5\" is not a whole number"),
        ("/s", "the limit is missing"),
        ("100/", "missing the period"),
        ("100/fortnight", "unknown period unit \"fortnight\""),
        ("100/5", "unknown period unit \"\""),
        ("10/s burst", "'burst' must be followed by a number"),
        ("10/s burst x", "the burst \"x\" is not a whole number"),
        ("10/s bursts 4", "unexpected \"bursts\" after the period"),
        ("10/s burst 4 now", "unexpected text after the burst"),
        ("10/99999999999999999999s", "the period count"),
        ("10/999999999999d", "longer than ~584 years"),
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
    // Well-formed strings with invalid values get the value's own error.
    assert_eq!("0/s".parse::<Quota>(), Err(ConfigError::ZeroLimit));
    assert_eq!("1/s burst 0".parse::<Quota>(), Err(ConfigError::ZeroBurst));
    assert_eq!("1/0s".parse::<Quota>(), Err(ConfigError::ZeroPeriod));
}

proptest! {
    /// Display writes what FromStr reads back.
    #[test]
    fn display_round_trips(limit in 1u64..1_000_000, period_ns in 1u64..1u64 << 50, burst in 1u64..1_000_000) {
        if let Ok(q) = Quota::new(limit, Duration::from_nanos(period_ns)).and_then(|q| q.with_burst(burst)) {
            prop_assert_eq!(q.to_string().parse::<Quota>(), Ok(q));
        }
    }

    /// No input string makes the parser panic.
    #[test]
    fn parser_never_panics(s in "\\PC{0,24}") {
        let _ = s.parse::<Quota>();
    }
}
