//! The example configuration file loads and builds, and a mistake in a file names its
//! field (cargo feature `serde`).
#![cfg(feature = "serde")]

use std::collections::BTreeMap;

use serde::Deserialize;
use tollgate::config::LimiterConfig;
use tollgate::{Algorithm, Quota, RateLimiter, WhenFull};

#[derive(Deserialize)]
struct File {
    limiters: BTreeMap<String, LimiterConfig>,
}

#[test]
fn the_example_file_builds_two_named_limiters() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/limiters.toml"
    ))
    .unwrap();
    let file: File = toml::from_str(&text).unwrap();
    assert_eq!(file.limiters.len(), 2);
    let api = &file.limiters["api"];
    assert_eq!(api.quota, "100/s burst 200".parse::<Quota>().unwrap());
    assert_eq!(api.max_keys, Some(1_000_000));
    let limiter: RateLimiter<String> = api.build().unwrap();
    assert_eq!(limiter.quota_for("partner-7").burst(), 2000);
    let login = &file.limiters["login"];
    assert_eq!(login.algorithm, Algorithm::SlidingWindow);
    assert_eq!(login.when_full, WhenFull::DenyNewKeys);
    let limiter: RateLimiter<String> = login.build().unwrap();
    for _ in 0..5 {
        assert!(limiter.check("mallory").is_allowed());
    }
    assert!(!limiter.check("mallory").is_allowed());
}

#[test]
fn quotas_read_json_in_both_forms() {
    let text: Quota = serde_json::from_str("\"100/s burst 20\"").unwrap();
    let map: Quota =
        serde_json::from_str(r#"{"limit": 100, "period": "1s", "burst": 20}"#).unwrap();
    assert_eq!(text, map);
    assert_eq!(text.burst(), 20);
}

#[test]
fn a_bad_file_names_the_field() {
    let text = "[limiters.api]\nquota = \"100/s\"\n[limiters.api.quotas]\nvip = \"ten/s\"\n";
    let e = toml::from_str::<File>(text).err().unwrap().to_string();
    assert!(e.contains("field `quotas.vip`"), "{e}");
    assert!(e.contains("the limit \"ten\" is not a whole number"), "{e}");
}

/// Each bad value's error names its field and points at the value itself: the line and
/// column of the value, not of the table around it.
#[test]
fn a_bad_value_gets_its_line_and_column() {
    let cases = [
        (
            "quota = \"100/parsec\"",
            "line 2, column 9",
            "field `quota`: invalid quota string",
        ),
        (
            "quota = \"10/s\"\nalgorithm = \"gcra\"",
            "line 3, column 13",
            "field `algorithm`: unknown algorithm \"gcra\"",
        ),
        (
            "quota = \"10/s\"\nwhen_full = \"drop\"",
            "line 3, column 13",
            "field `when_full`: unknown policy \"drop\"",
        ),
        (
            "quota = \"10/s\"\nshards = 3",
            "line 3, column 10",
            "field `shards`",
        ),
        (
            "quota = \"10/s\"\nmax_keys = 0",
            "line 3, column 12",
            "field `max_keys`",
        ),
        (
            "quota = \"10/s\"\nmax_keys = -1",
            "line 3, column 12",
            "field `max_keys`: -1 is negative",
        ),
        (
            "quota = { limit = 0, period = \"1s\" }",
            "line 2, column 9",
            "field `quota`",
        ),
        (
            "quota = \"10/s\"\n[limiters.api.quotas]\nvip = \"ten/s\"",
            "line 4, column 7",
            "field `quotas.vip`: invalid quota string \"ten/s\"",
        ),
        (
            "quota = \"10/s\"\nalso = [\"1000/day\", \"5/fortnight\"]",
            "line 3, column 21",
            "field `also[1]`: invalid quota string \"5/fortnight\"",
        ),
    ];
    for (body, at, says) in cases {
        let text = format!("[limiters.api]\n{body}\n");
        let e = toml::from_str::<File>(&text).err().unwrap().to_string();
        assert!(
            e.contains(&format!("TOML parse error at {at}")),
            "{text}: {e}"
        );
        assert!(e.contains(says), "{text}: {e}");
    }
}

/// `also` in a file holds every key to each listed quota as well.
#[test]
fn also_in_a_file_adds_quotas() {
    let text = "[limiters.api]\nquota = \"2/s\"\nalso = [\"3/min\"]\n";
    let file: File = toml::from_str(text).unwrap();
    let limiter: tollgate::RateLimiter<String> = file.limiters["api"].build().unwrap();
    assert_eq!(limiter.quotas().len(), 2);
    let admitted = (0..10).filter(|_| limiter.check("k").is_allowed()).count();
    assert_eq!(admitted, 2, "the burst of 2 ends it first");
    // And it writes back out as it was read.
    let written = toml::to_string(&file.limiters["api"]).unwrap();
    assert!(written.contains("also = ["), "{written}");
    let again: tollgate::config::LimiterConfig = toml::from_str(&written).unwrap();
    assert_eq!(again, file.limiters["api"]);
}
