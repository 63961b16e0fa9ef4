//! Figures over several seeds: each the mean of the seeds' runs with a 95% confidence interval
//! from Student's t, so a difference between policies can be told from the seeds' noise.

use serde_json::{Map, Value, json};

/// Student's t at 97.5% (two-sided 95%) for 1..=30 degrees of freedom.
const T_975: [f64; 30] = [
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
    2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
    2.052, 2.048, 2.045, 2.042,
];

/// Student's t at 97.5% for `df` degrees of freedom; past 30, the value at the table's next
/// lower row (40, 60, 120), which errs on the wide side.
fn t_975(df: usize) -> f64 {
    match df {
        0 => f64::NAN,
        1..=30 => T_975[df - 1],
        31..=40 => T_975[29],
        41..=60 => 2.021,
        61..=120 => 2.000,
        _ => 1.980,
    }
}

/// The mean of `values` and, with two or more, the 95% confidence interval of the mean:
/// `mean ± t(n − 1) · s / √n`, `s` the sample standard deviation.
pub fn mean_ci95(values: &[f64]) -> (f64, Option<[f64; 2]>) {
    let n = values.len();
    if n == 0 {
        return (f64::NAN, None);
    }
    // Equal values have no spread, whatever the rounding of their sum says.
    if values.iter().all(|v| *v == values[0]) {
        return (values[0], (n > 1).then_some([values[0]; 2]));
    }
    let mean = values.iter().sum::<f64>() / n as f64;
    let variance = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    let half = t_975(n - 1) * (variance / n as f64).sqrt();
    (mean, Some([mean - half, mean + half]))
}

/// Several seeds' JSON objects for one policy (the same keys) as one: every number the mean
/// over the seeds with `KEY_ci95` = `[low, high]` beside it, objects merged the same way,
/// arrays of numbers averaged element by element (no interval), anything else (and a key
/// some seeds lack) the first seed's. One seed's object is returned as it is.
pub fn over_seeds(mut runs: Vec<Map<String, Value>>) -> Map<String, Value> {
    if runs.len() < 2 {
        return runs.pop().unwrap_or_default();
    }
    let objects: Vec<&Map<String, Value>> = runs.iter().collect();
    merge(&objects)
}

fn merge(objects: &[&Map<String, Value>]) -> Map<String, Value> {
    let mut out = Map::new();
    for (key, first) in objects[0] {
        // A key some seeds lack (an error only some met) is the first seed's.
        let Some(values) = objects
            .iter()
            .map(|o| o.get(key))
            .collect::<Option<Vec<_>>>()
        else {
            out.insert(key.clone(), first.clone());
            continue;
        };
        if let Some(numbers) = all(&values, Value::as_f64) {
            let (mean, ci) = mean_ci95(&numbers);
            out.insert(key.clone(), json!(mean));
            out.insert(format!("{key}_ci95"), json!(ci));
        } else if let Some(inner) = all(&values, Value::as_object) {
            out.insert(key.clone(), Value::Object(merge(&inner)));
        } else if let Some(columns) = number_columns(&values) {
            let means: Vec<f64> = columns.iter().map(|c| mean_ci95(c).0).collect();
            out.insert(key.clone(), json!(means));
        } else {
            out.insert(key.clone(), first.clone());
        }
    }
    out
}

/// Each of `values` as `get` reads it, if every one reads.
fn all<'a, T>(values: &[&'a Value], get: impl Fn(&'a Value) -> Option<T>) -> Option<Vec<T>> {
    values.iter().map(|v| get(v)).collect()
}

/// Arrays of numbers, all of one length: the numbers at each position.
fn number_columns(values: &[&Value]) -> Option<Vec<Vec<f64>>> {
    let rows: Vec<Vec<f64>> = all(values, |v| {
        v.as_array()?
            .iter()
            .map(Value::as_f64)
            .collect::<Option<Vec<f64>>>()
    })?;
    let len = rows[0].len();
    if rows.iter().any(|r| r.len() != len) {
        return None;
    }
    Some(
        (0..len)
            .map(|i| rows.iter().map(|r| r[i]).collect())
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-3
    }

    #[test]
    fn the_interval_is_t_times_the_standard_error() {
        // Mean 3, s = 1.5811, s/√5 = 0.7071, t(4) = 2.776: ±1.963.
        let (mean, ci) = mean_ci95(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        let [low, high] = ci.unwrap();
        assert!(
            close(mean, 3.0) && close(low, 1.037) && close(high, 4.963),
            "{low} {high}"
        );
        // Two seeds: t(1) = 12.706, s/√2 = 0.5 for 1 and 2.
        let [low, high] = mean_ci95(&[1.0, 2.0]).1.unwrap();
        assert!(
            close(low, 1.5 - 6.353) && close(high, 1.5 + 6.353),
            "{low} {high}"
        );
        // More seeds, a narrower interval for the same spread.
        let wide = mean_ci95(&[1.0, 2.0, 1.0, 2.0]).1.unwrap();
        let narrow = mean_ci95(&[1.0, 2.0].repeat(8)).1.unwrap();
        assert!(narrow[1] - narrow[0] < (wide[1] - wide[0]) / 2.0);
        // Identical seeds: no spread, even where a sum of three rounds. One: no interval.
        assert_eq!(mean_ci95(&[4.0; 3]), (4.0, Some([4.0, 4.0])));
        assert_eq!(mean_ci95(&[0.1; 3]), (0.1, Some([0.1, 0.1])));
        assert_eq!(mean_ci95(&[4.0]), (4.0, None));
    }

    #[test]
    fn seeds_merge_field_by_field() {
        let run = |goodput: f64, ttft: f64| {
            json!({
                "request_goodput": goodput,
                "vs_first": {"p50_ttft_ms": ttft},
                "engine_utilisation": [goodput, ttft],
                "prefix_hit_rate": null,
                "name": "x",
            })
            .as_object()
            .unwrap()
            .clone()
        };
        let merged = over_seeds(vec![run(1.0, 10.0), run(3.0, 20.0)]);
        assert_eq!(merged["request_goodput"], json!(2.0));
        let [low, high] = mean_ci95(&[1.0, 3.0]).1.unwrap();
        assert_eq!(merged["request_goodput_ci95"], json!([low, high]));
        assert_eq!(merged["vs_first"]["p50_ttft_ms"], json!(15.0));
        assert!(merged["vs_first"]["p50_ttft_ms_ci95"].is_array());
        assert_eq!(merged["engine_utilisation"], json!([2.0, 15.0]));
        assert_eq!(merged["prefix_hit_rate"], Value::Null);
        assert_eq!(merged["name"], json!("x"));
        // One seed's fields stay as they are, integers included.
        let one = json!({"completed": 80}).as_object().unwrap().clone();
        assert_eq!(over_seeds(vec![one.clone()]), one);
    }
}
