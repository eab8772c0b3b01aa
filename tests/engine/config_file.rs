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

/// Plans in a file, in TOML, YAML and JSON alike: `quota` and `also` are the default
/// plan's, `plans` the others (a list or one quota each), `plan_of` the assigned keys.
#[test]
fn plans_read_from_toml_yaml_and_json_alike() {
    let toml_text = r#"
name = "api"
quota = "60/min"
also = ["10000/month calendar"]
algorithm = "fixed-window"
default_plan = "free"

[plans]
pro = ["600/min", "1000000/month calendar"]
internal = "100000/s"

[plan_of]
key-abc = "pro"
"#;
    let yaml_text = r#"
name: api
quota: 60/min
also: ["10000/month calendar"]
algorithm: fixed-window
default_plan: free
plans:
  pro: ["600/min", "1000000/month calendar"]
  internal: 100000/s
plan_of:
  key-abc: pro
"#;
    let json_text = r#"{
  "name": "api", "quota": "60/min", "also": ["10000/month calendar"],
  "algorithm": "fixed-window", "default_plan": "free",
  "plans": {"pro": ["600/min", "1000000/month calendar"], "internal": "100000/s"},
  "plan_of": {"key-abc": "pro"}
}"#;
    let from_toml: LimiterConfig = toml::from_str(toml_text).unwrap();
    let from_yaml: LimiterConfig = serde_yaml_ng::from_str(yaml_text).unwrap();
    let from_json: LimiterConfig = serde_json::from_str(json_text).unwrap();
    assert_eq!(from_toml, from_yaml);
    assert_eq!(from_toml, from_json);
    let plans = from_toml.build_plans::<String>().unwrap();
    assert_eq!(plans.plan_names().len(), 3);
    assert_eq!(plans.plan_of("key-abc").as_ref(), "pro");
    assert_eq!(plans.plan_of("anyone").as_ref(), "free");
    assert_eq!(
        plans.quotas_of("free").unwrap(),
        [q("60/min"), q("10000/month calendar")]
    );
    assert_eq!(plans.quotas_of("internal").unwrap(), [q("100000/s")]);
    assert_eq!(plans.check("key-abc").limit(), 600);
    // A plain limiter refuses a file of plans, rather than ignoring them.
    assert!(matches!(
        from_toml.build::<String>(),
        Err(tollgate::ConfigError::Unsupported(_))
    ));
    // And it writes back out as it was read.
    let written = toml::to_string(&from_toml).unwrap();
    assert_eq!(
        toml::from_str::<LimiterConfig>(&written).unwrap(),
        from_toml
    );
}

/// A bad plan in a file: its quota's error names the plan and the quota's index, at its
/// line in TOML and YAML; an unknown plan in `plan_of` and a plan named as the default
/// are typed errors at build.
#[test]
fn a_bad_plan_names_its_field_and_line() {
    let text = "quota = \"10/s\"\n[plans]\nok = \"20/s\"\npro = [\"600/min\", \"5/fortnight\"]\n";
    let e = toml::from_str::<LimiterConfig>(text)
        .unwrap_err()
        .to_string();
    assert!(e.contains("line 4, column 19"), "{e}");
    assert!(
        e.contains("field `plans.pro[1]`: invalid quota string \"5/fortnight\""),
        "{e}"
    );
    let yaml = "quota: 10/s\nplans:\n  pro: 10/parsec\n";
    let e = serde_yaml_ng::from_str::<LimiterConfig>(yaml)
        .unwrap_err()
        .to_string();
    assert!(e.contains("field `plans.pro`: invalid quota string"), "{e}");
    assert!(e.contains("line 3"), "{e}");
    let unknown: LimiterConfig =
        toml::from_str("quota = \"10/s\"\n[plan_of]\nk = \"gold\"\n").unwrap();
    assert!(matches!(
        unknown.build_plans::<String>(),
        Err(tollgate::ConfigError::UnknownPlan(p)) if p == "gold"
    ));
    let clash: LimiterConfig =
        toml::from_str("quota = \"10/s\"\n[plans]\ndefault = \"20/s\"\n").unwrap();
    assert!(matches!(
        clash.build_plans::<String>(),
        Err(tollgate::ConfigError::InvalidPlan { plan, .. }) if plan == "default"
    ));
}

fn q(text: &str) -> Quota {
    text.parse().unwrap()
}
