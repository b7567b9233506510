//! Launch choices from the environment. The library takes them as typed options
//! ([`SparseFwdTuning`], [`SparseBwdTuning`], each `None` field meaning the measured heuristic); this
//! module is the one place that reads the `FLASHMLA_*` variables naming them, for `check` and `bench`
//! (and for `bench --ab VAR=a,b`, which builds one [`Tuning`] per value).
//!
//! Every variable also takes an empty value or `auto`: the measured choice, as if it were unset. Any
//! other value outside the listed ones is an error, so a misspelt value cannot time the default.

use flashmla::ops::sparse_bwd::launch::MAX_KV_BUCKETS;
use flashmla::ops::sparse_bwd::{KvBucketOrder, SparseBwdTuning};
use flashmla::ops::sparse_fwd::{SparseFwdPipeline, SparseFwdPrefetch, SparseFwdTuning};

#[cfg(feature = "experiments")]
use crate::bench::experiments::{self, Experiments};

/// The launch choices of one run: the library's options, the bench experiments (with the
/// `experiments` feature) and the `VAR=value` assignments they came from.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tuning {
    /// Sparse forward launch choices.
    pub fwd: SparseFwdTuning,
    /// Sparse backward launch choices.
    pub bwd: SparseBwdTuning,
    /// Bench-only experiments.
    #[cfg(feature = "experiments")]
    pub experiments: Experiments,
    /// The assignments applied, `VAR=value`, in order.
    assigned: Vec<String>,
}

/// One variable: its name, the values it takes, and how a value sets a [`Tuning`].
struct Knob {
    name: &'static str,
    values: &'static str,
    /// Applies a value other than empty / `auto`; `Err(())` for a value outside `values`.
    set: fn(&mut Tuning, &str) -> Result<(), ()>,
    /// Resets the field to the measured choice.
    clear: fn(&mut Tuning),
}

/// `on` / `off`.
fn on_off(v: &str) -> Result<bool, ()> {
    match v {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(()),
    }
}

const KNOBS: &[Knob] = &[
    Knob {
        name: "FLASHMLA_SPARSE_FWD_PIPELINE",
        values: "split, alternating",
        set: |t, v| {
            t.fwd.pipeline = Some(match v {
                "split" => SparseFwdPipeline::Split,
                "alternating" => SparseFwdPipeline::Alternating,
                _ => return Err(()),
            });
            Ok(())
        },
        clear: |t| t.fwd.pipeline = None,
    },
    Knob {
        name: "FLASHMLA_SPARSE_FWD_PREFETCH",
        values: "rows, off",
        set: |t, v| {
            t.fwd.prefetch = Some(match v {
                "rows" => SparseFwdPrefetch::Rows,
                "off" => SparseFwdPrefetch::Off,
                _ => return Err(()),
            });
            Ok(())
        },
        clear: |t| t.fwd.prefetch = None,
    },
    Knob {
        name: "FLASHMLA_SPARSE_FWD_CLUSTER",
        values: "on, off",
        set: |t, v| {
            t.fwd.cluster = Some(on_off(v)?);
            Ok(())
        },
        clear: |t| t.fwd.cluster = None,
    },
    Knob {
        name: "FLASHMLA_SPARSE_BWD_KV_BUCKETS",
        values: "a bucket count 1..=63 (1: index order)",
        set: |t, v| {
            let n: usize = v.parse().map_err(|_| ())?;
            if !(1..=MAX_KV_BUCKETS).contains(&n) {
                return Err(());
            }
            t.bwd.kv_buckets = Some(n);
            Ok(())
        },
        clear: |t| t.bwd.kv_buckets = None,
    },
    Knob {
        name: "FLASHMLA_SPARSE_BWD_KV_BUCKET_ORDER",
        values: "alternating, ascending",
        set: |t, v| {
            t.bwd.bucket_order = Some(match v {
                "alternating" => KvBucketOrder::Alternating,
                "ascending" => KvBucketOrder::Ascending,
                _ => return Err(()),
            });
            Ok(())
        },
        clear: |t| t.bwd.bucket_order = None,
    },
    Knob {
        name: "FLASHMLA_SPARSE_BWD_PDL",
        values: "on, off",
        set: |t, v| {
            t.bwd.pdl = Some(on_off(v)?);
            Ok(())
        },
        clear: |t| t.bwd.pdl = None,
    },
    Knob {
        name: "FLASHMLA_SPARSE_BWD_DEFER",
        values: "on, off",
        set: |t, v| {
            t.bwd.defer_last_reduce = Some(on_off(v)?);
            Ok(())
        },
        clear: |t| t.bwd.defer_last_reduce = None,
    },
    Knob {
        name: "FLASHMLA_SPARSE_BWD_DRAIN_FIRST",
        values: "on, off",
        set: |t, v| {
            t.bwd.drain_first = Some(on_off(v)?);
            Ok(())
        },
        clear: |t| t.bwd.drain_first = None,
    },
    #[cfg(feature = "experiments")]
    Knob {
        name: experiments::ORDER_VAR,
        values: "index, waves, sorted, sorted-waves",
        set: |t, v| {
            t.experiments.fwd_order = Some(v.parse()?);
            Ok(())
        },
        clear: |t| t.experiments.fwd_order = None,
    },
    #[cfg(feature = "experiments")]
    Knob {
        name: experiments::PASSES_VAR,
        values: "1, 2",
        set: |t, v| {
            t.experiments.bwd_passes = Some(match v {
                "1" => 1,
                "2" => 2,
                _ => return Err(()),
            });
            Ok(())
        },
        clear: |t| t.experiments.bwd_passes = None,
    },
];

/// Variables of the bench experiments, which only a build with the `experiments` feature reads.
#[cfg(not(feature = "experiments"))]
const EXPERIMENT_VARS: &[&str] = &[
    "FLASHMLA_BENCH_SPARSE_FWD_ORDER",
    "FLASHMLA_BENCH_SPARSE_BWD_PASSES",
];

impl Tuning {
    /// The launch choices the process environment names.
    pub fn from_env() -> Result<Self, String> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// The launch choices that `get` (a variable's value, if set) names.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        #[cfg(not(feature = "experiments"))]
        if let Some(var) = EXPERIMENT_VARS.iter().find(|v| get(v).is_some()) {
            return Err(experiment_error(var));
        }
        let mut t = Tuning::default();
        for knob in KNOBS {
            if let Some(value) = get(knob.name) {
                t = t.with(knob.name, &value)?;
            }
        }
        Ok(t)
    }

    /// These choices with `var` set to `value` (replacing any earlier value of `var`).
    pub fn with(&self, var: &str, value: &str) -> Result<Self, String> {
        let Some(knob) = KNOBS.iter().find(|k| k.name == var) else {
            #[cfg(not(feature = "experiments"))]
            if EXPERIMENT_VARS.contains(&var) {
                return Err(experiment_error(var));
            }
            let known: Vec<&str> = KNOBS.iter().map(|k| k.name).collect();
            return Err(format!(
                "{var} is not a launch choice; the variables are {}",
                known.join(", ")
            ));
        };
        let value = value.trim();
        let mut t = self.clone();
        match value {
            "" | "auto" => (knob.clear)(&mut t),
            v => (knob.set)(&mut t, v).map_err(|()| {
                format!(
                    "{var}={value:?}: expected one of {} (or empty / auto for the measured choice)",
                    knob.values
                )
            })?,
        }
        let prefix = format!("{var}=");
        t.assigned.retain(|a| !a.starts_with(&prefix));
        t.assigned.push(format!("{var}={value}"));
        Ok(t)
    }

    /// The assignments these choices came from, space-separated (`None` when there were none).
    pub fn label(&self) -> Option<String> {
        (!self.assigned.is_empty()).then(|| self.assigned.join(" "))
    }
}

#[cfg(not(feature = "experiments"))]
fn experiment_error(var: &str) -> String {
    format!(
        "{var} is a bench experiment: build the flashmla CLI with `--features experiments` to use it"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn an_empty_environment_is_the_measured_choice() {
        let t = Tuning::from_lookup(|_| None).unwrap();
        assert_eq!(t, Tuning::default());
        assert_eq!(t.fwd, SparseFwdTuning::default());
        assert_eq!(t.bwd, SparseBwdTuning::default());
        assert_eq!(t.label(), None);
    }

    #[test]
    fn every_variable_sets_its_field() {
        let t = Tuning::from_lookup(lookup(&[
            ("FLASHMLA_SPARSE_FWD_PIPELINE", "split"),
            ("FLASHMLA_SPARSE_FWD_PREFETCH", "off"),
            ("FLASHMLA_SPARSE_FWD_CLUSTER", "off"),
            ("FLASHMLA_SPARSE_BWD_KV_BUCKETS", "7"),
            ("FLASHMLA_SPARSE_BWD_KV_BUCKET_ORDER", "ascending"),
            ("FLASHMLA_SPARSE_BWD_PDL", "off"),
            ("FLASHMLA_SPARSE_BWD_DEFER", " off "),
            ("FLASHMLA_SPARSE_BWD_DRAIN_FIRST", "on"),
        ]))
        .unwrap();
        assert_eq!(
            t.fwd,
            SparseFwdTuning {
                pipeline: Some(SparseFwdPipeline::Split),
                prefetch: Some(SparseFwdPrefetch::Off),
                cluster: Some(false),
            }
        );
        assert_eq!(
            t.bwd,
            SparseBwdTuning {
                kv_buckets: Some(7),
                bucket_order: Some(KvBucketOrder::Ascending),
                pdl: Some(false),
                drain_first: Some(true),
                defer_last_reduce: Some(false),
            }
        );
        let label = t.label().unwrap();
        assert!(
            label.starts_with("FLASHMLA_SPARSE_FWD_PIPELINE=split "),
            "{label}"
        );
        assert_eq!(label.split(' ').count(), 8, "{label}");
    }

    #[test]
    fn values_outside_the_list_are_errors_that_name_the_variable() {
        for (var, bad) in [
            ("FLASHMLA_SPARSE_FWD_PIPELINE", "alternate"),
            ("FLASHMLA_SPARSE_FWD_PREFETCH", "on"),
            ("FLASHMLA_SPARSE_BWD_KV_BUCKETS", "0"),
            ("FLASHMLA_SPARSE_BWD_KV_BUCKETS", "64"),
            ("FLASHMLA_SPARSE_BWD_KV_BUCKETS", "many"),
            ("FLASHMLA_SPARSE_BWD_PDL", "no"),
        ] {
            let e = Tuning::from_lookup(lookup(&[(var, bad)])).unwrap_err();
            assert!(e.contains(var) && e.contains("expected"), "{e}");
        }
        let e = Tuning::default().with("FLASHMLA_X", "1").unwrap_err();
        assert!(e.contains("not a launch choice"), "{e}");
    }

    #[test]
    fn ab_values_replace_the_environment_one_variable_at_a_time() {
        let base = Tuning::from_lookup(lookup(&[
            ("FLASHMLA_SPARSE_FWD_PIPELINE", "split"),
            ("FLASHMLA_SPARSE_BWD_PDL", "off"),
        ]))
        .unwrap();
        let alt = base
            .with("FLASHMLA_SPARSE_FWD_PIPELINE", "alternating")
            .unwrap();
        assert_eq!(alt.fwd.pipeline, Some(SparseFwdPipeline::Alternating));
        assert_eq!(alt.bwd.pdl, Some(false));
        assert_eq!(
            alt.label().as_deref(),
            Some("FLASHMLA_SPARSE_BWD_PDL=off FLASHMLA_SPARSE_FWD_PIPELINE=alternating")
        );
        for auto in ["", "auto"] {
            let t = base.with("FLASHMLA_SPARSE_FWD_PIPELINE", auto).unwrap();
            assert_eq!(t.fwd.pipeline, None);
            assert_eq!(t.bwd, base.bwd);
        }
    }

    #[cfg(not(feature = "experiments"))]
    #[test]
    fn experiment_variables_need_the_feature() {
        let e = Tuning::default()
            .with("FLASHMLA_BENCH_SPARSE_FWD_ORDER", "sorted")
            .unwrap_err();
        assert!(e.contains("--features experiments"), "{e}");
        let env = [("FLASHMLA_BENCH_SPARSE_BWD_PASSES", "2")];
        assert!(Tuning::from_lookup(lookup(&env)).is_err());
    }
}
