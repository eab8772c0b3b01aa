//! `GET /metrics`: every metric sent to the `metrics` facade, in Prometheus's text format.
//!
//! The server needs a recorder that keeps the latest value of each series and writes them
//! out on a scrape, nothing more: counters and gauges as they are, histograms as summaries
//! without quantiles (`_sum` and `_count`, from which a rate of either follows).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use metrics::{
    Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};

/// The recorder, and the handle that renders it: clones share the series.
#[derive(Clone, Default)]
pub struct Prometheus {
    inner: Arc<Mutex<Registry>>,
}

#[derive(Default)]
struct Registry {
    /// By metric name, then by rendered labels (`{a="x",b="y"}`, or empty).
    series: BTreeMap<String, BTreeMap<String, Series>>,
    help: BTreeMap<String, String>,
}

enum Series {
    Counter(Arc<AtomicU64>),
    /// The value's `f64` bits, as `metrics` stores a gauge in an `AtomicU64`.
    Gauge(Arc<AtomicU64>),
    Summary(Arc<Summary>),
}

/// A histogram's running count and sum.
#[derive(Default)]
struct Summary {
    count_sum: Mutex<(u64, f64)>,
}

impl HistogramFn for Summary {
    fn record(&self, value: f64) {
        let mut count_sum = self
            .count_sum
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        count_sum.0 += 1;
        count_sum.1 += value;
    }
}

impl Prometheus {
    /// Installs a new recorder as the process's `metrics` recorder.
    ///
    /// # Errors
    /// When a recorder is installed already.
    pub fn install() -> Result<Self, String> {
        let recorder = Self::default();
        metrics::set_global_recorder(recorder.clone())
            .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
        Ok(recorder)
    }

    /// Every series, grouped by metric, with its `# HELP` (when described) and `# TYPE`.
    pub fn render(&self) -> String {
        let registry = self.lock();
        let mut out = String::new();
        for (name, series) in &registry.series {
            let Some(first) = series.values().next() else {
                continue;
            };
            if let Some(help) = registry.help.get(name) {
                let _ = writeln!(out, "# HELP {name} {}", help.replace('\n', " "));
            }
            let kind = match first {
                Series::Counter(_) => "counter",
                Series::Gauge(_) => "gauge",
                Series::Summary(_) => "summary",
            };
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for (labels, value) in series {
                match value {
                    Series::Counter(v) => {
                        let _ = writeln!(out, "{name}{labels} {}", v.load(Ordering::Relaxed));
                    }
                    Series::Gauge(v) => {
                        let v = f64::from_bits(v.load(Ordering::Relaxed));
                        let _ = writeln!(out, "{name}{labels} {v}");
                    }
                    Series::Summary(s) => {
                        let (count, sum) =
                            *s.count_sum.lock().unwrap_or_else(PoisonError::into_inner);
                        let _ = writeln!(out, "{name}_sum{labels} {sum}");
                        let _ = writeln!(out, "{name}_count{labels} {count}");
                    }
                }
            }
        }
        out
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The series of `key`, made by `new` the first time it is seen.
    fn series<T>(
        &self,
        key: &Key,
        new: impl FnOnce() -> Series,
        get: impl Fn(&Series) -> Option<T>,
    ) -> Option<T> {
        let mut registry = self.lock();
        let series = registry
            .series
            .entry(sanitize(key.name()))
            .or_default()
            .entry(labels(key))
            .or_insert_with(new);
        get(series)
    }

    fn describe(&self, key: &KeyName, description: &SharedString) {
        self.lock()
            .help
            .insert(sanitize(key.as_str()), description.to_string());
    }
}

impl Recorder for Prometheus {
    fn describe_counter(&self, key: KeyName, _: Option<Unit>, description: SharedString) {
        self.describe(&key, &description);
    }

    fn describe_gauge(&self, key: KeyName, _: Option<Unit>, description: SharedString) {
        self.describe(&key, &description);
    }

    fn describe_histogram(&self, key: KeyName, _: Option<Unit>, description: SharedString) {
        self.describe(&key, &description);
    }

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let new = || Series::Counter(Arc::default());
        self.series(key, new, |s| match s {
            Series::Counter(v) => Some(Counter::from_arc(Arc::clone(v))),
            _ => None,
        })
        .unwrap_or_else(Counter::noop)
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        let new = || Series::Gauge(Arc::default());
        self.series(key, new, |s| match s {
            Series::Gauge(v) => Some(Gauge::from_arc(Arc::clone(v))),
            _ => None,
        })
        .unwrap_or_else(Gauge::noop)
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        let new = || Series::Summary(Arc::default());
        self.series(key, new, |s| match s {
            Series::Summary(v) => Some(Histogram::from_arc(Arc::clone(v))),
            _ => None,
        })
        .unwrap_or_else(Histogram::noop)
    }
}

/// A metric or label name as Prometheus accepts it: `[a-zA-Z_:][a-zA-Z0-9_:]*`.
fn sanitize(name: &str) -> String {
    let mut out: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if out.is_empty() || out.starts_with(|c: char| c.is_ascii_digit()) {
        out.insert(0, '_');
    }
    out
}

/// `{name="value",...}` in the key's label order, values escaped; empty without labels.
fn labels(key: &Key) -> String {
    let mut out = String::new();
    for (i, label) in key.labels().enumerate() {
        out.push(if i == 0 { '{' } else { ',' });
        out.push_str(&sanitize(label.key()));
        out.push_str("=\"");
        for c in label.value().chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '"' => out.push_str("\\\""),
                '\n' => out.push_str("\\n"),
                c => out.push(c),
            }
        }
        out.push('"');
    }
    if !out.is_empty() {
        out.push('}');
    }
    out
}
