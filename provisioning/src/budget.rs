//! A run's dollar budget: when what its rented machines have cost reaches
//! it, the run is torn down (or paused), a little before, so that it is
//! never overspent by more than the time that takes.
//!
//! Pure: the spend is an argument (the daemon sums it from what its
//! providers rent), and so is nothing else: a verdict depends only on the
//! budget, the dollars spent and what the run costs per hour now.

use serde::{Deserialize, Serialize};

/// How long before its budget would be spent a run is acted on: about
/// what a teardown of rented machines takes, so the machines are gone by
/// the time the budget is.
pub const LEAD_MS: u64 = 30_000;

/// Minutes left before the budget at which a run says so, once each, from
/// the loosest to the tightest.
pub const WARNINGS_MIN: [u64; 5] = [60, 30, 10, 5, 1];

/// Millionths of a dollar in a dollar.
const MICROS: f64 = 1e6;
const HOUR_MS: u128 = 3_600_000;

/// What a run may spend, and what happens when it has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budget {
    /// Dollars, in millionths.
    pub usd_micros: u64,
    /// What reaching it does.
    #[serde(default)]
    pub on_reached: OnBudget,
}

/// What a run does when its budget is reached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnBudget {
    /// Tear the run down: every machine is released (`swactor down`).
    #[default]
    Down,
    /// Pause it (`swactor pause`): nothing new is rented; what runs goes
    /// on costing until someone acts.
    Pause,
}

impl OnBudget {
    /// The word a shape file uses.
    pub fn word(self) -> &'static str {
        match self {
            Self::Down => "down",
            Self::Pause => "pause",
        }
    }

    /// Reads the word a shape file uses.
    ///
    /// # Errors
    /// Another word, in words.
    pub fn parse(word: &str) -> Result<Self, String> {
        match word {
            "down" => Ok(Self::Down),
            "pause" => Ok(Self::Pause),
            other => Err(format!(
                "on_budget = {other:?}: it is \"down\" (tear the run down, the default) or \
                 \"pause\""
            )),
        }
    }
}

impl Budget {
    /// A budget of `usd` dollars.
    ///
    /// # Errors
    /// Not a positive, finite amount, or more than a million dollars.
    pub fn of_usd(usd: f64, on_reached: OnBudget) -> Result<Self, String> {
        if !usd.is_finite() || usd <= 0.0 || usd > 1e6 {
            return Err(format!(
                "budget_usd = {usd}: it must be a positive number of dollars, at most 1000000"
            ));
        }
        Ok(Self {
            usd_micros: (usd * MICROS).round() as u64,
            on_reached,
        })
    }
}

/// `usd` dollars in millionths: negative and NaN amounts are 0, huge
/// ones saturate.
pub fn usd_micros(usd: f64) -> u64 {
    // `as` saturates and maps NaN to 0.
    (usd.max(0.0) * MICROS).round() as u64
}

/// What a run has cost and costs, as its providers account for it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spend {
    /// Dollars spent so far, in millionths: every machine's price over its
    /// lifetime, ended ones included.
    pub spent_micros: u64,
    /// What the machines rented now cost together, in millionths of a
    /// dollar per hour.
    pub usd_per_hour_micros: u64,
}

/// Where a run stands against its budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verdict {
    /// Under it. `left_ms`: how long until it is reached at the present
    /// rate (`None` when nothing is rented).
    Within {
        /// Time left, in ms.
        left_ms: Option<u64>,
    },
    /// Reached, or it would be within [`LEAD_MS`]: act now.
    Reached,
}

/// Where a run that spent `spend` stands against `budget`.
pub fn verdict(budget: &Budget, spend: Spend) -> Verdict {
    let rate = u128::from(spend.usd_per_hour_micros);
    let spent = u128::from(spend.spent_micros);
    let limit = u128::from(budget.usd_micros);
    // What is spent by the time an action taken now has taken effect.
    let by_then = spent + rate * u128::from(LEAD_MS) / HOUR_MS;
    if by_then >= limit {
        return Verdict::Reached;
    }
    let left_ms = (rate > 0).then(|| {
        let ms = (limit - spent) * HOUR_MS / rate;
        u64::try_from(ms).unwrap_or(u64::MAX)
    });
    Verdict::Within { left_ms }
}

/// Whether a run with `left_ms` to go (`None`: nothing rented) should say
/// so now, given `warned`, the index in [`WARNINGS_MIN`] of the last
/// warning given (`None`: none since the run last had an hour or more
/// left). Returns the new `warned`, and whether to warn.
pub fn warning_due(left_ms: Option<u64>, warned: Option<usize>) -> (Option<usize>, bool) {
    let left_min = left_ms.map_or(u64::MAX, |ms| ms / 60_000);
    // The tightest threshold passed.
    match WARNINGS_MIN.iter().rposition(|m| left_min < *m) {
        Some(i) if warned.is_none_or(|w| i > w) => (Some(i), true),
        Some(_) => (warned, false),
        // An hour or more again (the budget was raised): warn afresh.
        None => (None, false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(usd: f64) -> Budget {
        Budget::of_usd(usd, OnBudget::Down).unwrap()
    }

    fn spend(spent_usd: f64, usd_per_hour: f64) -> Spend {
        Spend {
            spent_micros: (spent_usd * 1e6) as u64,
            usd_per_hour_micros: (usd_per_hour * 1e6) as u64,
        }
    }

    #[test]
    fn dollars_become_millionths_never_negative() {
        assert_eq!(usd_micros(1.25), 1_250_000);
        assert_eq!(usd_micros(0.000_000_4), 0);
        assert_eq!(usd_micros(0.000_000_6), 1);
        assert_eq!(usd_micros(-3.0), 0);
        assert_eq!(usd_micros(f64::NAN), 0);
        assert_eq!(usd_micros(f64::INFINITY), u64::MAX);
    }

    #[test]
    fn a_run_is_within_its_budget_until_the_lead_before_it_and_says_how_long_is_left() {
        // 10 $ at 1.2 $/h with 9 $ spent: 50 minutes left.
        assert_eq!(
            verdict(&budget(10.0), spend(9.0, 1.2)),
            Verdict::Within {
                left_ms: Some(3_000_000)
            }
        );
        // Nothing rented: no end in sight, whatever was spent.
        assert_eq!(
            verdict(&budget(10.0), spend(9.99, 0.0)),
            Verdict::Within { left_ms: None }
        );
        // 36 $/h is a cent a second: at 30 s from the budget, act.
        assert_eq!(verdict(&budget(10.0), spend(9.70, 36.0)), Verdict::Reached);
        assert!(matches!(
            verdict(&budget(10.0), spend(9.69, 36.0)),
            Verdict::Within { .. }
        ));
        // Spent (or overspent) is reached, even with nothing rented.
        assert_eq!(verdict(&budget(10.0), spend(10.0, 0.0)), Verdict::Reached);
        assert_eq!(verdict(&budget(10.0), spend(12.0, 1.0)), Verdict::Reached);
    }

    #[test]
    fn each_warning_is_given_once_from_the_loosest_to_the_tightest() {
        let min = |m: u64| Some(m * 60_000);
        let mut warned = None;
        let mut said = Vec::new();
        for left in [90, 59, 45, 29, 29, 12, 9, 9, 4, 3, 0] {
            let (w, due) = warning_due(min(left), warned);
            warned = w;
            if due {
                said.push(left);
            }
        }
        assert_eq!(said, [59, 29, 9, 4, 0]);
        // A raised budget starts the warnings over; nothing rented, none.
        assert_eq!(warning_due(min(61), warned), (None, false));
        assert_eq!(warning_due(None, None), (None, false));
        // A jump straight to the last minute says it once.
        assert_eq!(warning_due(min(0), None), (Some(4), true));
        assert_eq!(warning_due(min(0), Some(4)), (Some(4), false));
    }

    #[test]
    fn budgets_and_their_action_are_read_with_reasons() {
        assert_eq!(budget(0.05).usd_micros, 50_000);
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 2e6] {
            assert!(Budget::of_usd(bad, OnBudget::Down).is_err(), "{bad}");
        }
        assert_eq!(OnBudget::parse("pause"), Ok(OnBudget::Pause));
        assert_eq!(OnBudget::parse("down").map(OnBudget::word), Ok("down"));
        assert!(OnBudget::parse("stop").unwrap_err().contains("\"pause\""));
    }
}
