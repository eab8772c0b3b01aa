//! Limiters from configuration files (cargo feature `serde`).
//!
//! A [`Quota`] reads and writes its string form (`"100/s burst 20"`), and also reads a map
//! `{ limit, period, burst }` whose period is a duration string (`"1s"`, `"30s"`,
//! `"1min"`) or whole seconds. [`Algorithm`] and [`WhenFull`] are kebab-case strings
//! (`"token-bucket"`, `"deny-new-keys"`). A [`LimiterConfig`] holds everything a limiter
//! is built from:
//!
//! ```
//! use tollgate::config::LimiterConfig;
//!
//! let config: LimiterConfig = toml::from_str(r#"
//!     name = "api"
//!     quota = "100/s burst 20"
//!     algorithm = "sliding-window"
//!     max_keys = 100000
//!     expected_keys = 20000
//!     when_full = "deny-new-keys"
//!
//!     [quotas]
//!     partner-key = { limit = 1000, period = "1s" }
//! "#)?;
//! let limiter = config.build::<String>()?;
//! assert_eq!(limiter.name(), "api");
//! assert_eq!(limiter.quota_for("partner-key").limit(), 1000);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Errors name the field and say what is wrong, for example
//! ``field `quotas.partner-key`: invalid quota string "10/parsec": unknown period unit…``.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::algorithm::Algorithm;
use crate::clock::MonotonicClock;
use crate::error::ConfigError;
use crate::limiter::{Key, RateLimiter};
use crate::plans::Plans;
use crate::quota::Quota;
use crate::store::WhenFull;

impl Serialize for Quota {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Quota {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(QuotaVisitor { field: None })
    }
}

/// `error`, prefixed with the name of the file's field it is about, if any.
fn named(field: Option<&str>, error: impl fmt::Display) -> String {
    match field {
        Some(field) => format!("field `{field}`: {error}"),
        None => error.to_string(),
    }
}

/// Reads a quota's string or map form. Its errors name `field`: they are made while the
/// deserializer is on the value, so a TOML error points at the value's line and column.
struct QuotaVisitor<'a> {
    field: Option<&'a str>,
}

impl<'de> Visitor<'de> for QuotaVisitor<'_> {
    type Value = Quota;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            r#"a quota: a string such as "100/s burst 20", or a map { limit, period, burst }"#,
        )
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Quota, E> {
        text.parse().map_err(|e| E::custom(named(self.field, e)))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Quota, A::Error> {
        let (mut limit, mut period, mut burst) = (None, None, None);
        while let Some(field) = map.next_key::<String>()? {
            match field.as_str() {
                "limit" => limit = Some(map.next_value::<u64>()?),
                "period" => period = Some(map.next_value::<Period>()?.0),
                "burst" => burst = Some(map.next_value::<u64>()?),
                other => {
                    return Err(de::Error::unknown_field(
                        other,
                        &["limit", "period", "burst"],
                    ));
                }
            }
        }
        let limit = limit.ok_or_else(|| de::Error::missing_field("limit"))?;
        let period = period.ok_or_else(|| de::Error::missing_field("period"))?;
        let quota =
            Quota::new(limit, period).map_err(|e| de::Error::custom(named(self.field, e)))?;
        match burst {
            Some(burst) => quota
                .with_burst(burst)
                .map_err(|e| de::Error::custom(named(self.field, e))),
            None => Ok(quota),
        }
    }
}

/// A quota map's period: a duration string (`"1s"`, `"30s"`, `"1min"`, `"250ms"`) or
/// whole seconds.
struct Period(Duration);

impl<'de> Deserialize<'de> for Period {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PeriodVisitor;
        impl Visitor<'_> for PeriodVisitor {
            type Value = Period;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(r#"a period: a string such as "1s", "30s" or "1min", or whole seconds"#)
            }

            fn visit_u64<E: de::Error>(self, secs: u64) -> Result<Period, E> {
                Ok(Period(Duration::from_secs(secs)))
            }

            fn visit_i64<E: de::Error>(self, secs: i64) -> Result<Period, E> {
                u64::try_from(secs)
                    .map(|s| Period(Duration::from_secs(s)))
                    .map_err(|_| E::custom(format!("the period must not be negative ({secs})")))
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<Period, E> {
                crate::quota::parse_period(text.trim())
                    .map(|ns| Period(Duration::from_nanos(ns)))
                    .map_err(|reason| E::custom(format!("invalid period {text:?}: {reason}")))
            }
        }
        deserializer.deserialize_any(PeriodVisitor)
    }
}

/// Everything a limiter is built from, as it appears in a configuration file. Only
/// `quota` is required.
///
/// ```
/// use tollgate::config::LimiterConfig;
/// use tollgate::{Algorithm, RateLimiter};
///
/// let mut config = LimiterConfig::new("100/s".parse()?);
/// config.algorithm = Algorithm::FixedWindow;
/// config.quotas.insert("vip".to_owned(), "1000/s".parse()?);
/// let limiter: RateLimiter<String> = config.build()?;
/// assert_eq!(limiter.quota_for("vip").limit(), 1000);
/// assert_eq!(limiter.algorithm(), Algorithm::FixedWindow);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "RawConfig")]
#[non_exhaustive]
pub struct LimiterConfig {
    /// The limiter's name (metrics and logs); `"default"` unless given.
    pub name: String,
    /// The default quota.
    pub quota: Quota,
    /// Further quotas every key is held to, all or nothing
    /// ([`Builder::also`](crate::Builder::also)); none unless given. In a file:
    /// `also = ["1000/day"]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub also: Vec<Quota>,
    /// The algorithm; `token-bucket` unless given.
    pub algorithm: Algorithm,
    /// The shard count (a power of two); four per CPU unless given.
    pub shards: Option<usize>,
    /// The most keys the limiter holds; no cap unless given.
    pub max_keys: Option<usize>,
    /// The keys the tables are sized for when the limiter is built
    /// ([`Builder::expected_keys`](crate::Builder::expected_keys)); none unless given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_keys: Option<usize>,
    /// What a full limiter does with a new key; `evict-least-active` unless given.
    pub when_full: WhenFull,
    /// Keys with a quota of their own.
    pub quotas: BTreeMap<String, Quota>,
    /// The name of the plan that `quota` and `also` define, for
    /// [`build_plans`](Self::build_plans); `"default"` unless given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_plan: Option<String>,
    /// Further plans, each a list of quotas (or one quota), for
    /// [`build_plans`](Self::build_plans). In a file: `[plans]` then `pro = ["600/min",
    /// "100000/month calendar"]`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub plans: BTreeMap<String, Vec<Quota>>,
    /// Keys assigned to a plan ([`Plans::assign`]). In a file: `[plan_of]` then
    /// `"key-abc" = "pro"`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub plan_of: BTreeMap<String, String>,
}

impl LimiterConfig {
    /// A configuration of `quota` with every other setting at its default.
    pub fn new(quota: Quota) -> Self {
        Self {
            name: "default".to_owned(),
            quota,
            also: Vec::new(),
            algorithm: Algorithm::default(),
            shards: None,
            max_keys: None,
            expected_keys: None,
            when_full: WhenFull::default(),
            quotas: BTreeMap::new(),
            default_plan: None,
            plans: BTreeMap::new(),
            plan_of: BTreeMap::new(),
        }
    }

    /// Builds the limiter, keyed by `K` (the keys of `quotas` are parsed as `K`).
    ///
    /// # Errors
    /// Those of [`Builder::build`](crate::Builder::build) and
    /// [`RateLimiter::set_quota`], and [`ConfigError::InvalidKey`] for a key of
    /// `quotas` that is not a `K`.
    pub fn build<K>(&self) -> Result<RateLimiter<K, MonotonicClock>, ConfigError>
    where
        K: Key + Clone + FromStr,
    {
        if !self.plans.is_empty() || !self.plan_of.is_empty() {
            return Err(ConfigError::Unsupported(
                "this configuration defines plans (`plans`, `plan_of`): build it with \
                 LimiterConfig::build_plans",
            ));
        }
        let mut builder = RateLimiter::<K>::builder(self.quota)
            .algorithm(self.algorithm)
            .when_full(self.when_full)
            .name(&self.name);
        builder = self.sized(builder);
        for &quota in &self.also {
            builder = builder.also(quota);
        }
        let limiter = builder.build()?;
        for (key, quota) in &self.quotas {
            let parsed = key
                .parse::<K>()
                .map_err(|_| ConfigError::InvalidKey(key.clone()))?;
            limiter.set_quota(&parsed, *quota)?;
        }
        Ok(limiter)
    }
}

impl LimiterConfig {
    /// Builds a limiter of plans, keyed by `K`: the default plan (named by
    /// `default_plan`, `"default"` unless given) holds `quota` and `also`, then each of
    /// `plans`; the keys of `plan_of` are assigned to their plan. `quotas` (keys with a
    /// quota of their own) do not apply to plans and are refused.
    ///
    /// ```
    /// use tollgate::config::LimiterConfig;
    ///
    /// let config: LimiterConfig = toml::from_str(r#"
    ///     name = "api"
    ///     quota = "60/min"
    ///     also = ["10000/month calendar"]
    ///     algorithm = "fixed-window"
    ///     default_plan = "free"
    ///
    ///     [plans]
    ///     pro = ["600/min", "1000000/month calendar"]
    ///     internal = "100000/s"
    ///
    ///     [plan_of]
    ///     key-abc = "pro"
    /// "#)?;
    /// let plans = config.build_plans::<String>()?;
    /// assert_eq!(plans.plan_of("key-abc").as_ref(), "pro");
    /// assert_eq!(plans.plan_of("anyone").as_ref(), "free");
    /// assert_eq!(plans.check("key-abc").limit(), 600);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// Those of [`PlansBuilder::build`](crate::plans::PlansBuilder::build);
    /// [`ConfigError::UnknownPlan`] for a plan of `plan_of` that is not defined;
    /// [`ConfigError::InvalidPlan`] for a plan of `plans` with the default plan's name;
    /// [`ConfigError::InvalidKey`] for a key that is not a `K`;
    /// [`ConfigError::Unsupported`] for `quotas`.
    pub fn build_plans<K>(&self) -> Result<Plans<K, MonotonicClock>, ConfigError>
    where
        K: Key + Clone + FromStr,
    {
        if !self.quotas.is_empty() {
            return Err(ConfigError::Unsupported(
                "`quotas` (a key's own quota) with plans: define a plan and assign the key \
                 to it in `plan_of`",
            ));
        }
        let default = self.default_plan.as_deref().unwrap_or("default");
        if self.plans.contains_key(default) {
            return Err(ConfigError::InvalidPlan {
                plan: default.to_owned(),
                why: "`quota` and `also` define the default plan: give the other plans \
                      other names, or name the default plan with `default_plan`",
            });
        }
        let mut own = vec![self.quota];
        own.extend_from_slice(&self.also);
        let mut builder = Plans::<K>::builder(default)
            .name(&self.name)
            .algorithm(self.algorithm)
            .when_full(self.when_full)
            .plan(default, own);
        for (name, quotas) in &self.plans {
            builder = builder.plan(name, quotas.iter().copied());
        }
        builder = self.sized(builder);
        let plans = builder.build()?;
        for (key, plan) in &self.plan_of {
            let parsed = key
                .parse::<K>()
                .map_err(|_| ConfigError::InvalidKey(key.clone()))?;
            plans.assign(&parsed, plan)?;
        }
        Ok(plans)
    }
}

impl LimiterConfig {
    /// `builder` with the file's shard count, key cap and expected keys, where given.
    fn sized<B: Sizes>(&self, mut builder: B) -> B {
        if let Some(shards) = self.shards {
            builder = builder.shards(shards);
        }
        if let Some(max_keys) = self.max_keys {
            builder = builder.max_keys(max_keys);
        }
        if let Some(keys) = self.expected_keys {
            builder = builder.expected_keys(keys);
        }
        builder
    }
}

/// The builders a file's sizes apply to: a limiter's and a limiter of plans'.
trait Sizes: Sized {
    fn shards(self, shards: usize) -> Self;
    fn max_keys(self, max_keys: usize) -> Self;
    fn expected_keys(self, keys: usize) -> Self;
}

/// Implements [`Sizes`] for a builder type by its own methods of the same names.
macro_rules! sizes {
    ($builder:ty) => {
        impl<K: Key> Sizes for $builder {
            fn shards(self, shards: usize) -> Self {
                <$builder>::shards(self, shards)
            }
            fn max_keys(self, max_keys: usize) -> Self {
                <$builder>::max_keys(self, max_keys)
            }
            fn expected_keys(self, keys: usize) -> Self {
                <$builder>::expected_keys(self, keys)
            }
        }
    };
}

sizes!(crate::limiter::Builder<K>);
sizes!(crate::plans::PlansBuilder<K>);

/// The file's form of a [`LimiterConfig`], each field checked as it is read, so that an
/// error names its field and a TOML error points at the value's line and column.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    name: Option<String>,
    #[serde(deserialize_with = "quota_field")]
    quota: Quota,
    #[serde(default, deserialize_with = "also_field")]
    also: Vec<Quota>,
    #[serde(default, deserialize_with = "algorithm_field")]
    algorithm: Algorithm,
    #[serde(default, deserialize_with = "shards_field")]
    shards: Option<usize>,
    #[serde(default, deserialize_with = "max_keys_field")]
    max_keys: Option<usize>,
    #[serde(default)]
    expected_keys: Option<usize>,
    #[serde(default, deserialize_with = "when_full_field")]
    when_full: WhenFull,
    #[serde(default, deserialize_with = "quotas_field")]
    quotas: BTreeMap<String, Quota>,
    #[serde(default)]
    default_plan: Option<String>,
    #[serde(default, deserialize_with = "plans_field")]
    plans: BTreeMap<String, Vec<Quota>>,
    #[serde(default)]
    plan_of: BTreeMap<String, String>,
}

fn quota_field<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Quota, D::Error> {
    de::DeserializeSeed::deserialize(QuotaSeed("quota"), deserializer)
}

/// The `also` list: each quota read with its index in the field's name (`also[1]`).
fn also_field<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<Quota>, D::Error> {
    struct Also;
    impl<'de> Visitor<'de> for Also {
        type Value = Vec<Quota>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a list of quotas, such as [\"1000/day\"]")
        }

        fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut quotas = Vec::new();
            loop {
                let field = format!("also[{}]", quotas.len());
                match seq.next_element_seed(QuotaSeed(&field))? {
                    Some(quota) => quotas.push(quota),
                    None => return Ok(quotas),
                }
            }
        }
    }
    deserializer.deserialize_seq(Also)
}

/// The `quotas` table: each value read with its key in the field's name
/// (`quotas.partner`).
fn quotas_field<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<BTreeMap<String, Quota>, D::Error> {
    struct Quotas;
    impl<'de> Visitor<'de> for Quotas {
        type Value = BTreeMap<String, Quota>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a table of keys and their quotas")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut quotas = BTreeMap::new();
            while let Some(key) = map.next_key::<String>()? {
                let field = format!("quotas.{key}");
                let quota = map.next_value_seed(QuotaSeed(&field))?;
                quotas.insert(key, quota);
            }
            Ok(quotas)
        }
    }
    deserializer.deserialize_map(Quotas)
}

/// The `plans` table: each plan's quotas (a list, or one quota) read with the plan and
/// the quota's index in the field's name (`plans.pro[1]`).
fn plans_field<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<BTreeMap<String, Vec<Quota>>, D::Error> {
    struct PlanTable;
    impl<'de> Visitor<'de> for PlanTable {
        type Value = BTreeMap<String, Vec<Quota>>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a table of plans, each a list of quotas such as [\"600/min\"]")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut plans = BTreeMap::new();
            while let Some(name) = map.next_key::<String>()? {
                let quotas = map.next_value_seed(PlanSeed(&name))?;
                plans.insert(name, quotas);
            }
            Ok(plans)
        }
    }
    deserializer.deserialize_map(PlanTable)
}

/// One plan's quotas: a list, or a single quota.
struct PlanSeed<'a>(&'a str);

impl<'de> de::DeserializeSeed<'de> for PlanSeed<'_> {
    type Value = Vec<Quota>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Vec<Quota>, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PlanSeed<'_> {
    type Value = Vec<Quota>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "plan {:?}: a list of quotas, or one quota", self.0)
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Vec<Quota>, E> {
        let field = format!("plans.{}", self.0);
        QuotaVisitor {
            field: Some(&field),
        }
        .visit_str(text)
        .map(|q| vec![q])
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Vec<Quota>, A::Error> {
        let field = format!("plans.{}", self.0);
        QuotaVisitor {
            field: Some(&field),
        }
        .visit_map(map)
        .map(|q| vec![q])
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<Quota>, A::Error> {
        let mut quotas = Vec::new();
        loop {
            let field = format!("plans.{}[{}]", self.0, quotas.len());
            match seq.next_element_seed(QuotaSeed(&field))? {
                Some(quota) => quotas.push(quota),
                None => return Ok(quotas),
            }
        }
    }
}

/// A quota read as the value of the field it names.
struct QuotaSeed<'a>(&'a str);

impl<'de> de::DeserializeSeed<'de> for QuotaSeed<'_> {
    type Value = Quota;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Quota, D::Error> {
        deserializer.deserialize_any(QuotaVisitor {
            field: Some(self.0),
        })
    }
}

/// A string field parsed by `parse`, whose error names the field.
struct Parsed<'a, T> {
    field: &'a str,
    expecting: &'a str,
    parse: fn(&str) -> Result<T, String>,
}

impl<T> Visitor<'_> for Parsed<'_, T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<T, E> {
        (self.parse)(text).map_err(|e| E::custom(named(Some(self.field), e)))
    }
}

fn algorithm_field<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Algorithm, D::Error> {
    deserializer.deserialize_str(Parsed {
        field: "algorithm",
        expecting: "an algorithm name such as \"token-bucket\"",
        parse: |text| text.parse().map_err(|e: ConfigError| e.to_string()),
    })
}

fn when_full_field<'de, D: Deserializer<'de>>(deserializer: D) -> Result<WhenFull, D::Error> {
    deserializer.deserialize_str(Parsed {
        field: "when_full",
        expecting: "\"evict-least-active\" or \"deny-new-keys\"",
        parse: parse_when_full,
    })
}

/// A [`WhenFull`] policy's name in files.
fn when_full_name(policy: WhenFull) -> &'static str {
    match policy {
        WhenFull::EvictLeastActive => "evict-least-active",
        WhenFull::DenyNewKeys => "deny-new-keys",
    }
}

fn parse_when_full(text: &str) -> Result<WhenFull, String> {
    [WhenFull::EvictLeastActive, WhenFull::DenyNewKeys]
        .into_iter()
        .find(|policy| when_full_name(*policy) == text)
        .ok_or_else(|| {
            format!("unknown policy {text:?}: use \"evict-least-active\" or \"deny-new-keys\"")
        })
}

/// A whole number field, checked by `check` as it is read.
struct Count<'a> {
    field: &'a str,
    check: fn(usize) -> Result<usize, ConfigError>,
}

impl Visitor<'_> for Count<'_> {
    type Value = Option<usize>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a whole number")
    }

    fn visit_u64<E: de::Error>(self, n: u64) -> Result<Option<usize>, E> {
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        (self.check)(n)
            .map(Some)
            .map_err(|e| E::custom(named(Some(self.field), e)))
    }

    fn visit_i64<E: de::Error>(self, n: i64) -> Result<Option<usize>, E> {
        match u64::try_from(n) {
            Ok(n) => self.visit_u64(n),
            Err(_) => Err(E::custom(named(
                Some(self.field),
                format!("{n} is negative: use a whole number"),
            ))),
        }
    }
}

fn shards_field<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<usize>, D::Error> {
    deserializer.deserialize_any(Count {
        field: "shards",
        check: |shards| {
            if crate::limiter::valid_shards(shards) {
                Ok(shards)
            } else {
                Err(ConfigError::InvalidShards(shards))
            }
        },
    })
}

fn max_keys_field<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<usize>, D::Error> {
    deserializer.deserialize_any(Count {
        field: "max_keys",
        check: |max_keys| {
            if max_keys == 0 {
                Err(ConfigError::ZeroMaxKeys)
            } else {
                Ok(max_keys)
            }
        },
    })
}

impl From<RawConfig> for LimiterConfig {
    fn from(raw: RawConfig) -> Self {
        Self {
            name: raw.name.unwrap_or_else(|| "default".to_owned()),
            quota: raw.quota,
            also: raw.also,
            algorithm: raw.algorithm,
            shards: raw.shards,
            max_keys: raw.max_keys,
            expected_keys: raw.expected_keys,
            when_full: raw.when_full,
            quotas: raw.quotas,
            default_plan: raw.default_plan,
            plans: raw.plans,
            plan_of: raw.plan_of,
        }
    }
}

impl Serialize for Algorithm {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Algorithm {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        name.parse().map_err(de::Error::custom)
    }
}

impl Serialize for WhenFull {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(when_full_name(*self))
    }
}

impl<'de> Deserialize<'de> for WhenFull {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        parse_when_full(&name).map_err(de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotas_read_both_forms_and_write_the_string() {
        let text: Quota = serde_json::from_str("\"100/s burst 20\"").unwrap();
        let map: Quota =
            serde_json::from_str(r#"{ "limit": 100, "period": "1s", "burst": 20 }"#).unwrap();
        assert_eq!(text, map);
        let secs: Quota = serde_json::from_str(r#"{ "limit": 600, "period": 60 }"#).unwrap();
        assert_eq!(secs, "600/min".parse().unwrap());
        assert_eq!(serde_json::to_string(&text).unwrap(), "\"100/s burst 20\"");
        let back: Quota = serde_json::from_str(&serde_json::to_string(&secs).unwrap()).unwrap();
        assert_eq!(back, secs);
    }

    #[test]
    fn bad_quotas_say_what_is_wrong() {
        let e = serde_json::from_str::<Quota>("\"10/parsec\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("10/parsec"), "{e}");
        let e = serde_json::from_str::<Quota>(r#"{ "limit": 0, "period": "1s" }"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("quota limit is 0"), "{e}");
        let e = serde_json::from_str::<Quota>(r#"{ "limit": 5 }"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing field `period`"), "{e}");
        let e = serde_json::from_str::<Quota>(r#"{ "limit": 5, "period": "1s", "brust": 2 }"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `brust`"), "{e}");
        let e = serde_json::from_str::<Quota>("42").unwrap_err().to_string();
        assert!(e.contains("a quota"), "{e}");
    }

    #[test]
    fn algorithms_and_policies_are_kebab_case() {
        for a in Algorithm::ALL {
            let json = serde_json::to_string(&a).unwrap();
            assert_eq!(json, format!("\"{}\"", a.name()));
            assert_eq!(serde_json::from_str::<Algorithm>(&json).unwrap(), a);
        }
        assert!(
            serde_json::from_str::<Algorithm>("\"token_bucket\"")
                .unwrap_err()
                .to_string()
                .contains("token_bucket")
        );
        assert_eq!(
            serde_json::to_string(&WhenFull::DenyNewKeys).unwrap(),
            "\"deny-new-keys\""
        );
        // Both policies read back what they write, and only that.
        for policy in [WhenFull::EvictLeastActive, WhenFull::DenyNewKeys] {
            let text = serde_json::to_string(&policy).unwrap();
            assert_eq!(serde_json::from_str::<WhenFull>(&text).unwrap(), policy);
        }
        assert!(
            serde_json::from_str::<WhenFull>("\"drop\"")
                .unwrap_err()
                .to_string()
                .contains("unknown policy \"drop\"")
        );
    }

    #[test]
    fn configs_name_the_field_that_is_wrong() {
        let cases = [
            (r#"quota = "10/parsec""#, "field `quota`"),
            (
                "quota = \"10/s\"\nalgorithm = \"token_bucket\"",
                "field `algorithm`",
            ),
            ("quota = \"10/s\"\nshards = 3", "field `shards`"),
            // 128 GiB of shards aborted the process.
            ("quota = \"10/s\"\nshards = 1073741824", "from 1 to 65,536"),
            ("quota = \"10/s\"\nmax_keys = 0", "field `max_keys`"),
            (
                "quota = \"10/s\"\nwhen_full = \"panic\"",
                "field `when_full`",
            ),
            (
                "quota = \"10/s\"\n[quotas]\nvip = { limit = 0, period = \"1s\" }",
                "field `quotas.vip`",
            ),
            ("quota = \"10/s\"\nqouta = 1", "unknown field `qouta`"),
            ("algorithm = \"fixed-window\"", "missing field `quota`"),
        ];
        for (text, expected) in cases {
            let e = toml::from_str::<LimiterConfig>(text)
                .unwrap_err()
                .to_string();
            assert!(e.contains(expected), "{text:?}: {e}");
        }
    }

    #[test]
    fn a_config_round_trips_and_builds() {
        let config: LimiterConfig = toml::from_str(
            "name = \"api\"\nquota = \"100/s burst 20\"\nalgorithm = \"leaky-bucket\"\n\
             shards = 4\nmax_keys = 10\nwhen_full = \"deny-new-keys\"\n\
             [quotas]\n7 = \"5/s\"\n",
        )
        .unwrap();
        let text = toml::to_string(&config).unwrap();
        assert_eq!(toml::from_str::<LimiterConfig>(&text).unwrap(), config);
        let limiter = config.build::<u64>().unwrap();
        assert_eq!(limiter.name(), "api");
        assert_eq!(limiter.algorithm(), Algorithm::LeakyBucket);
        assert_eq!(limiter.shards(), 4);
        assert_eq!(limiter.quota_for(&7).limit(), 5);
        let bad_key = LimiterConfig {
            quotas: BTreeMap::from([("not-a-number".to_owned(), config.quota)]),
            ..config
        };
        assert_eq!(
            bad_key.build::<u64>().unwrap_err(),
            ConfigError::InvalidKey("not-a-number".to_owned())
        );
    }
}
