//! The one rule by which key placeholders and fingerprints read JSON numbers.
//!
//! A JSON number is a decimal value, and it is read as that value, never through a
//! binary float: `100`, `100.0`, `1e2` and `1000E-1` are the same number, `-0` is `0`,
//! and `18446744073709551616` and `…617` (beyond 64 bits) or `0.1` and
//! `0.1000000000000000055511151231257827` (beyond an `f64`) are different numbers.
//!
//! The canonical text of a value `D × 10^k` (`D` an integer without trailing zeros):
//! * plain decimal notation, with no exponent, no trailing fraction zeros and no
//!   fraction at all when the value is integral (`100`, `-12.5`, `0.0015`), when that
//!   is at most [`PLAIN_MAX`] characters long;
//! * otherwise `DeK` (`1e400`, `-25e-300`), so that a hostile exponent costs its own
//!   length, not its value.
//!
//! Different values have different canonical texts, and equal values the same one.

use std::fmt::Write as _;

/// The longest number, in characters, written in plain notation.
pub(crate) const PLAIN_MAX: usize = 100;

/// A JSON number whose exponent does not fit in 64 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OutOfRange;

/// Appends the canonical text of the JSON number `text` (RFC 8259 grammar, as
/// `serde_json` validated it) to `out`.
pub(crate) fn canonical(text: &str, out: &mut String) -> Result<(), OutOfRange> {
    let (negative, unsigned) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = match unsigned.find(['e', 'E']) {
        Some(at) => (&unsigned[..at], &unsigned[at + 1..]),
        None => (unsigned, ""),
    };
    let (integer, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = integer.bytes().chain(fraction.bytes());
    let digits: Vec<u8> = digits.skip_while(|&d| d == b'0').collect();
    let kept = digits.iter().rposition(|&d| d != b'0').map_or(0, |last| last + 1);
    if kept == 0 {
        // Zero, whatever its exponent.
        out.push('0');
        return Ok(());
    }
    let exponent: i64 = match exponent.strip_prefix('+').unwrap_or(exponent) {
        "" => 0,
        digits => digits.parse().map_err(|_| OutOfRange)?,
    };
    // The value is `digits × 10^scale`, `digits` being `integer` and `fraction`
    // written together without their leading and trailing zeros. Computed wide, so
    // that equal values written with the exponent at the edge of 64 bits agree; only
    // a scale that does not fit in 64 bits itself is out of range.
    let dropped = (digits.len() - kept) as i128;
    let scale = i128::from(exponent) - fraction.len() as i128 + dropped;
    let scale = i64::try_from(scale).map_err(|_| OutOfRange)?;
    let digits = std::str::from_utf8(&digits[..kept]).map_err(|_| OutOfRange)?;

    if negative {
        out.push('-');
    }
    let len = digits.len() as u64;
    let plain_len = match scale {
        0.. => len.saturating_add(scale.unsigned_abs()),
        _ if scale.unsigned_abs() >= len => scale.unsigned_abs().saturating_add(2),
        _ => len + 1,
    };
    if plain_len > PLAIN_MAX as u64 {
        let _ = write!(out, "{digits}e{scale}");
        return Ok(());
    }
    // `scale` is now within ±PLAIN_MAX.
    let shift = scale.unsigned_abs() as usize;
    if scale >= 0 {
        out.push_str(digits);
        out.extend(std::iter::repeat_n('0', shift));
    } else if shift >= digits.len() {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', shift - digits.len()));
        out.push_str(digits);
    } else {
        let point = digits.len() - shift;
        out.push_str(&digits[..point]);
        out.push('.');
        out.push_str(&digits[point..]);
    }
    Ok(())
}

/// Whether `serde_json::Value` numbers keep their text (serde_json's
/// `arbitrary_precision` feature is on in this build), rather than go through an f64.
pub(crate) fn exact_values() -> bool {
    static EXACT: std::sync::LazyLock<bool> = std::sync::LazyLock::new(|| {
        let big = "18446744073709551616.5";
        let parsed = serde_json::from_str::<serde_json::Value>(big);
        parsed.is_ok_and(|v| serde_json::to_string(&v).is_ok_and(|text| text == big))
    });
    *EXACT
}

/// Appends the canonical text of a number `serde_json` parsed.
pub(crate) fn canonical_value(n: &serde_json::Number, out: &mut String) -> Result<(), OutOfRange> {
    if let Some(u) = n.as_u64() {
        let _ = write!(out, "{u}");
        Ok(())
    } else if let Some(i) = n.as_i64() {
        let _ = write!(out, "{i}");
        Ok(())
    } else {
        canonical(&n.to_string(), out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn text(number: &str) -> String {
        let mut out = String::new();
        canonical(number, &mut out).unwrap();
        out
    }

    #[test]
    fn examples() {
        for (number, expected) in [
            ("0", "0"),
            ("-0", "0"),
            ("-0.0e-5", "0"),
            ("7", "7"),
            ("100", "100"),
            ("100.0", "100"),
            ("1e2", "100"),
            ("1E+2", "100"),
            ("1000e-1", "100"),
            ("0.01e4", "100"),
            ("-12.50", "-12.5"),
            ("1.5e-3", "0.0015"),
            ("0.1000000000000000055511151231257827", "0.1000000000000000055511151231257827"),
            ("18446744073709551616", "18446744073709551616"),
            ("1e99", &format!("1{}", "0".repeat(99))),
            ("1e100", "1e100"),
            ("-25e-300", "-25e-300"),
            ("1e-98", &format!("0.{}1", "0".repeat(97))),
            ("1e-99", "1e-99"),
            ("10e999999998", "1e999999999"),
        ] {
            assert_eq!(text(number), expected, "{number}");
        }
        let mut out = String::new();
        assert_eq!(canonical("1e99999999999999999999", &mut out), Err(OutOfRange));
        assert_eq!(canonical("0.1e-9223372036854775808", &mut out), Err(OutOfRange));
        assert_eq!(text("1e-9223372036854775808"), "1e-9223372036854775808");
        assert_eq!(text("1.0e-9223372036854775808"), "1e-9223372036854775808");
        assert_eq!(text("10e-9223372036854775808"), "1e-9223372036854775807");
        assert_eq!(text("0e99999999999999999999"), "0", "zero, whatever its exponent");
        assert_eq!(text("-0.000e-99999999999999999999"), "0");
    }

    /// A decimal value `digits × 10^scale`, and ways to write it.
    fn written(digits: u64, scale: i32, zeros: usize, shift: i32, style: u8) -> String {
        // digits × 10^scale == (digits × 10^zeros) × 10^(scale - zeros)
        //                   == that with the point moved `shift` places, exponent + shift.
        let mantissa = format!("{digits}{}", "0".repeat(zeros));
        let exponent = i64::from(scale) - zeros as i64;
        match style % 3 {
            0 if exponent >= 0 => format!("{mantissa}{}", "0".repeat(exponent as usize)),
            1 => {
                let shift = shift.unsigned_abs() as usize;
                let padded = format!("{}{mantissa}", "0".repeat(shift));
                let point = padded.len() - shift;
                let (int, frac) = padded.split_at(point);
                let int = if int.is_empty() { "0" } else { int };
                let frac = if frac.is_empty() { "0".to_owned() } else { frac.to_owned() };
                format!("{int}.{frac}e{}", exponent + shift as i64)
            }
            _ => format!("{mantissa}E{exponent}"),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        /// Every way of writing a value renders the same text.
        #[test]
        fn equal_values_render_equally(
            digits in 1u64..u64::MAX, scale in -150i32..150, zeros in 0usize..5,
            shift in 0i32..30, a in 0u8..3, b in 0u8..3,
        ) {
            let one = written(digits, scale, zeros, shift, a);
            let other = written(digits, scale, 0, shift / 2, b);
            prop_assert_eq!(text(&one), text(&other), "{} vs {}", one, other);
        }

        /// Different values render differently.
        #[test]
        fn different_values_render_differently(
            x in 1u64..u64::MAX, xs in -150i32..150, y in 1u64..u64::MAX, ys in -150i32..150,
            negative in any::<bool>(),
        ) {
            let strip = |mut d: u64, mut s: i32| { while d % 10 == 0 { d /= 10; s += 1; } (d, s) };
            let sign = if negative { "-" } else { "" };
            let (one, other) = (format!("{sign}{x}e{xs}"), format!("{y}e{ys}"));
            prop_assert_eq!(
                text(&one) == text(&other),
                !negative && strip(x, xs) == strip(y, ys),
                "{} vs {}", one, other
            );
        }

        /// Numbers `serde_json` holds exactly render as their value.
        #[test]
        fn agrees_with_integers_and_floats(i in any::<i64>(), f in any::<f64>()) {
            prop_assert_eq!(text(&i.to_string()), i.to_string());
            prop_assume!(f.is_finite());
            let rendered = text(&serde_json::Number::from_f64(f).unwrap().to_string());
            prop_assert_eq!(rendered.parse::<f64>().unwrap(), f + 0.0);
        }
    }
}
