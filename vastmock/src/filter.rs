//! Vast.ai's filter language over JSON rows: `{"field": {"op": value}}`, and row ordering.
//!
//! Operators: `eq`, `neq`, `lt`, `lte`, `gt`, `gte`, `in`, `notin`. Values
//! are compared by the row's type: the official CLI sends numbers as strings
//! (`"num_gpus": {"eq": "1"}`), so a string value against a numeric field is
//! parsed; strings compare with `_` and space as the same character (the
//! CLI writes `RTX_4090` for `RTX 4090`). A filter on a field a row does not
//! have is ignored, and a bare value (`"rentable": true`) means `eq`.
//!
//! `geolocation` is stored as `"Texas, US"` but filtered by its two-letter
//! country code, as the client documents it (`geolocation in [US,CA]`; the
//! service compares a code derived from the place): `eq`/`in` match the code
//! (any case) or the whole string, and the order operators compare the code.

use serde_json::Value;
use std::cmp::Ordering;

/// Why a filter cannot be applied.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum FilterError {
    /// An operator outside the language.
    #[error("unknown operator {op:?} on field {field:?}")]
    UnknownOp {
        /// The field.
        field: String,
        /// The operator.
        op: String,
    },
    /// `in`/`notin` with something other than a list.
    #[error("operator {op:?} on field {field:?} needs a list")]
    NotAList {
        /// The field.
        field: String,
        /// The operator.
        op: String,
    },
}

/// Whether `row` passes every filter in `filters` (fields listed in `skip` are not filters).
///
/// # Errors
/// An unknown operator, or `in`/`notin` without a list.
pub(crate) fn matches(
    row: &Value,
    filters: &serde_json::Map<String, Value>,
    skip: &[&str],
) -> Result<bool, FilterError> {
    for (field, cond) in filters {
        if skip.contains(&field.as_str()) {
            continue;
        }
        let Some(have) = row.get(field) else {
            continue;
        };
        let conds: Vec<(&str, &Value)> = match cond {
            Value::Object(ops) => ops.iter().map(|(k, v)| (k.as_str(), v)).collect(),
            bare => vec![("eq", bare)],
        };
        for (op, want) in conds {
            if !test(field, have, op, want)? {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

fn test(field: &str, have: &Value, op: &str, want: &Value) -> Result<bool, FilterError> {
    if field == "geolocation"
        && let Value::String(place) = have
    {
        return test_geolocation(place, op, want);
    }
    test_plain(field, have, op, want)
}

fn test_plain(field: &str, have: &Value, op: &str, want: &Value) -> Result<bool, FilterError> {
    let list = || match want {
        Value::Array(items) => Ok(items),
        _ => Err(FilterError::NotAList {
            field: field.to_owned(),
            op: op.to_owned(),
        }),
    };
    Ok(match op {
        "eq" => compare(have, want) == Some(Ordering::Equal),
        "neq" | "ne" => compare(have, want) != Some(Ordering::Equal),
        "lt" => compare(have, want) == Some(Ordering::Less),
        "lte" => matches!(compare(have, want), Some(Ordering::Less | Ordering::Equal)),
        "gt" => compare(have, want) == Some(Ordering::Greater),
        "gte" => matches!(
            compare(have, want),
            Some(Ordering::Greater | Ordering::Equal)
        ),
        "in" => list()?
            .iter()
            .any(|w| compare(have, w) == Some(Ordering::Equal)),
        "notin" | "nin" => !list()?
            .iter()
            .any(|w| compare(have, w) == Some(Ordering::Equal)),
        _ => {
            return Err(FilterError::UnknownOp {
                field: field.to_owned(),
                op: op.to_owned(),
            });
        }
    })
}

/// The two-letter country code of a place: `"Texas, US"` → `"US"`.
pub(crate) fn country_code(place: &str) -> String {
    place
        .rsplit(',')
        .next()
        .unwrap_or(place)
        .trim()
        .to_ascii_uppercase()
}

fn test_geolocation(place: &str, op: &str, want: &Value) -> Result<bool, FilterError> {
    let code = Value::String(country_code(place));
    let is = |w: &Value| {
        let w_code = match w {
            Value::String(s) => Value::String(s.trim().to_ascii_uppercase()),
            other => other.clone(),
        };
        compare(&code, &w_code) == Some(Ordering::Equal)
            || compare(&Value::String(place.to_owned()), w) == Some(Ordering::Equal)
    };
    let list = || match want {
        Value::Array(items) => Ok(items),
        _ => Err(FilterError::NotAList {
            field: "geolocation".to_owned(),
            op: op.to_owned(),
        }),
    };
    match op {
        "eq" => Ok(is(want)),
        "neq" | "ne" => Ok(!is(want)),
        "in" => Ok(list()?.iter().any(is)),
        "notin" | "nin" => Ok(!list()?.iter().any(is)),
        _ => {
            let want = match want {
                Value::String(s) => Value::String(s.trim().to_ascii_uppercase()),
                other => other.clone(),
            };
            test_plain("geolocation", &code, op, &want)
        }
    }
}

/// Compares a row's value with a filter's value, by the row value's type;
/// `None` when they cannot be compared.
pub(crate) fn compare(have: &Value, want: &Value) -> Option<Ordering> {
    match (have, want) {
        (Value::Null, Value::Null) => Some(Ordering::Equal),
        (Value::Null, _) | (_, Value::Null) => None,
        (Value::Number(h), w) => {
            let h = h.as_f64()?;
            let w = match w {
                Value::Number(n) => n.as_f64()?,
                Value::String(s) => s.trim().parse::<f64>().ok()?,
                Value::Bool(b) => f64::from(u8::from(*b)),
                _ => return None,
            };
            h.partial_cmp(&w)
        }
        (Value::Bool(h), w) => {
            let w = match w {
                Value::Bool(b) => *b,
                Value::String(s) => match s.to_ascii_lowercase().as_str() {
                    "true" => true,
                    "false" => false,
                    _ => return None,
                },
                Value::Number(n) => n.as_f64()? != 0.0,
                _ => return None,
            };
            Some(h.cmp(&w))
        }
        (Value::String(h), w) => {
            let w = match w {
                Value::String(s) => s.clone(),
                Value::Number(n) => n.to_string(),
                Value::Bool(b) => b.to_string(),
                _ => return None,
            };
            Some(normalize(h).cmp(&normalize(&w)))
        }
        _ => None,
    }
}

fn normalize(s: &str) -> String {
    s.replace('_', " ")
}

/// Orders rows by `(column, descending)` keys, then by `id` ascending.
/// Missing and null values sort first.
pub(crate) fn sort_rows(rows: &mut [Value], keys: &[(String, bool)]) {
    rows.sort_by(|a, b| {
        for (col, desc) in keys {
            let ord = order_values(a.get(col), b.get(col));
            let ord = if *desc { ord.reverse() } else { ord };
            if ord != Ordering::Equal {
                return ord;
            }
        }
        order_values(a.get("id"), b.get("id"))
    });
}

fn order_values(a: Option<&Value>, b: Option<&Value>) -> Ordering {
    let a = a.filter(|v| !v.is_null());
    let b = b.filter(|v| !v.is_null());
    match (a, b) {
        (None, None) => Ordering::Equal,
        (None, Some(_)) => Ordering::Less,
        (Some(_), None) => Ordering::Greater,
        (Some(a), Some(b)) => compare(a, b).unwrap_or_else(|| a.to_string().cmp(&b.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ok(row: Value, filters: Value) -> bool {
        matches(&row, filters.as_object().unwrap(), &[]).unwrap()
    }

    #[test]
    fn string_numbers_and_underscores_match_like_the_cli_sends_them() {
        let row =
            json!({"num_gpus": 1, "gpu_name": "RTX 4090", "dph_total": 0.35, "rentable": true});
        assert!(ok(row.clone(), json!({"num_gpus": {"eq": "1"}})));
        assert!(ok(row.clone(), json!({"gpu_name": {"eq": "RTX_4090"}})));
        assert!(ok(
            row.clone(),
            json!({"gpu_name": {"in": ["RTX 3090", "RTX_4090"]}})
        ));
        assert!(!ok(
            row.clone(),
            json!({"gpu_name": {"notin": ["RTX_4090"]}})
        ));
        assert!(ok(
            row.clone(),
            json!({"dph_total": {"lte": 0.35, "gt": "0.1"}})
        ));
        assert!(!ok(row.clone(), json!({"dph_total": {"lt": 0.35}})));
        assert!(ok(
            row.clone(),
            json!({"rentable": {"eq": true}, "unknown": {"eq": 3}})
        ));
        assert!(!ok(row.clone(), json!({"rentable": {"neq": "true"}})));
        assert!(ok(
            json!({"label": null}),
            json!({"label": {"in": [null, "x"]}})
        ));
    }

    #[test]
    fn geolocation_filters_by_the_country_code() {
        let us = json!({"geolocation": "Texas, US"});
        assert!(ok(us.clone(), json!({"geolocation": {"in": ["US", "CA"]}})));
        assert!(ok(us.clone(), json!({"geolocation": {"eq": "us"}})));
        assert!(ok(us.clone(), json!({"geolocation": {"eq": "Texas, US"}})));
        assert!(!ok(us.clone(), json!({"geolocation": {"notin": ["US"]}})));
        assert!(ok(us.clone(), json!({"geolocation": {"neq": "CA"}})));
        assert!(!ok(
            json!({"geolocation": "Sweden, SE"}),
            json!({"geolocation": {"in": ["US", "CA"]}})
        ));
        assert!(ok(
            json!({"geolocation": "CA"}),
            json!({"geolocation": {"in": ["US", "CA"]}})
        ));
        let f = json!({"geolocation": {"like": "US"}});
        assert!(matches(&us, f.as_object().unwrap(), &[]).is_err());
    }

    #[test]
    fn unknown_operators_are_errors() {
        let row = json!({"a": 1});
        let f = json!({"a": {"like": 1}});
        assert!(matches(&row, f.as_object().unwrap(), &[]).is_err());
    }
}
