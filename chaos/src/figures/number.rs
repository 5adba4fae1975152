//! Numbers as the docs write them: whole counts with thousands separators
//! (`11,223`), measurements to three significant digits (`4.23`, `98.2`,
//! `421`), ratios to two decimals (`0.60`).

/// `x` rounded to a whole number, with thousands separators.
pub fn count(x: f64) -> String {
    let n = x.round() as i64;
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, d) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(d);
    }
    if n < 0 {
        out.insert(0, '-');
    }
    out
}

/// `x` to three significant digits (whole numbers from 100 up, with
/// separators).
pub fn sig(x: f64) -> String {
    let a = x.abs();
    if a >= 99.95 || a == 0.0 {
        return count(x);
    }
    let decimals = (2 - a.log10().floor() as i32).clamp(0, 6) as usize;
    format!("{x:.decimals$}")
}

/// A ratio to two decimals.
pub fn ratio(x: f64) -> String {
    format!("{x:.2}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_have_separators() {
        assert_eq!(count(11223.4), "11,223");
        assert_eq!(count(1_038.0), "1,038");
        assert_eq!(count(100_000.0), "100,000");
        assert_eq!(count(999.6), "1,000");
        assert_eq!(count(-254.0), "-254");
        assert_eq!(count(7.0), "7");
    }

    #[test]
    fn measurements_have_three_significant_digits() {
        assert_eq!(sig(4.227), "4.23");
        assert_eq!(sig(98.2), "98.2");
        assert_eq!(sig(421.3), "421");
        assert_eq!(sig(0.553), "0.553");
        assert_eq!(sig(18_352.0), "18,352");
        assert_eq!(sig(99.97), "100");
        assert_eq!(sig(0.0), "0");
        assert_eq!(ratio(0.603), "0.60");
    }
}
