//! Human durations in attribute arguments, parsed at compile time: `"30s"`, `"1500ms"`, `"2m"`,
//! `"1h"`, and sums of them such as `"1m30s"`.

use std::time::Duration;

/// The units accepted, largest first so that [`format`] names a duration with the fewest digits.
const UNITS: [(&str, u64); 4] = [("h", 3_600_000), ("m", 60_000), ("s", 1_000), ("ms", 1)];

/// Parses `s` into a duration, or says what is wrong with it. The messages name the part at
/// fault, because the span they are reported at covers the whole literal.
pub(crate) fn parse(s: &str) -> Result<Duration, String> {
    let text = s.trim();
    if text.is_empty() {
        return Err("empty duration; write a whole number and a unit, e.g. \"30s\"".to_owned());
    }
    // Spaces are read past rather than refused on the spot, so that `"2 weeks"` is reported
    // for its unit, the real problem, and a well-formed `"1m 30s"` gets its corrected spelling.
    let mut spaced = false;
    let mut rest = text;
    let mut total_ms: u64 = 0;
    while !rest.is_empty() {
        let int_len = digits(rest);
        let (has_point, frac_len) = match rest[int_len..].strip_prefix('.') {
            Some(after) => (true, digits(after)),
            None => (false, 0),
        };
        if int_len + frac_len == 0 {
            return Err(no_number(rest));
        }
        let (number, after) = rest.split_at(int_len + usize::from(has_point) + frac_len);
        let unit_text = after.trim_start();
        spaced |= unit_text.len() != after.len();
        let unit_len = unit_text
            .find(|c: char| c.is_ascii_digit() || c.is_whitespace())
            .unwrap_or(unit_text.len());
        let (unit, tail) = unit_text.split_at(unit_len);
        let Some(&(_, factor)) = UNITS.iter().find(|(u, _)| *u == unit) else {
            return Err(bad_unit(number, unit, has_point));
        };
        if has_point {
            return Err(fraction(number, unit, factor));
        }
        let too_large = || format!("`{number}{unit}` is too large: {LIMIT}");
        let value: u64 = number.parse().map_err(|_| too_large())?;
        total_ms = value
            .checked_mul(factor)
            .ok_or_else(too_large)?
            .checked_add(total_ms)
            .ok_or_else(|| format!("the sum is too large: {LIMIT}"))?;
        rest = tail.trim_start();
        spaced |= rest.len() != tail.len();
    }
    if spaced {
        let compact: String = text.split_whitespace().collect();
        return Err(format!(
            "spaces are not allowed inside a duration; write \"{compact}\""
        ));
    }
    Ok(Duration::from_millis(total_ms))
}

/// What a duration too large to count says about the limit.
const LIMIT: &str = "a duration counts milliseconds in a u64";

/// The shortest spelling of `d` in one unit, as it would be written in an attribute: `1500ms`,
/// `90s`, `24h`. Sub-millisecond parts are dropped; the parser cannot produce them.
pub(crate) fn format(d: Duration) -> String {
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    if ms == 0 {
        return "0s".to_owned();
    }
    let (unit, factor) = UNITS
        .iter()
        .find(|(_, f)| ms % f == 0)
        .unwrap_or(&UNITS[UNITS.len() - 1]);
    format!("{}{unit}", ms / factor)
}

/// The length of the run of ASCII digits `s` starts with.
fn digits(s: &str) -> usize {
    s.bytes().take_while(u8::is_ascii_digit).count()
}

/// Why `rest`, which does not start with a number, cannot go on.
fn no_number(rest: &str) -> String {
    if rest.starts_with('-') {
        return "a duration cannot be negative".to_owned();
    }
    let word_len = rest
        .find(|c: char| c.is_ascii_digit() || c.is_whitespace())
        .unwrap_or(rest.len());
    let word = &rest[..word_len];
    if UNITS.iter().any(|(u, _)| *u == word) {
        format!("`{word}` needs a number before it, e.g. \"30{word}\"")
    } else {
        format!(
            "expected a number at `{rest}`; a duration is a whole number and a unit (ms, s, m or h), \
             or a sum of them: \"30s\", \"1500ms\", \"1m30s\""
        )
    }
}

/// Why `unit`, read after `number`, is not a unit.
fn bad_unit(number: &str, unit: &str, has_point: bool) -> String {
    if unit.is_empty() && has_point {
        format!(
            "`{number}` needs a unit (ms, s, m or h), and fractions are not supported: \
             use a whole number of a smaller unit"
        )
    } else if unit.is_empty() {
        format!("`{number}` needs a unit (ms, s, m or h), e.g. \"{number}s\"")
    } else if unit.chars().all(char::is_alphabetic) {
        format!("unknown unit `{unit}`; use ms, s, m or h")
    } else {
        format!("unexpected `{unit}` after `{number}`; expected a unit (ms, s, m or h)")
    }
}

/// Why `number` with a decimal point cannot be used, with the whole-number spelling of the same
/// duration when there is one.
fn fraction(number: &str, unit: &str, factor: u64) -> String {
    match whole_ms(number, factor) {
        Whole::Ms(ms) => format!(
            "fractions are not supported; write {} instead of {number}{unit}",
            format(Duration::from_millis(ms))
        ),
        Whole::No => format!(
            "fractions are not supported, and {number}{unit} is not a whole number of milliseconds"
        ),
        Whole::TooLarge => format!("`{number}{unit}` is too large: {LIMIT}"),
    }
}

enum Whole {
    Ms(u64),
    No,
    TooLarge,
}

/// `number` (digits, a point, digits) times `factor` milliseconds, if that is a whole number.
fn whole_ms(number: &str, factor: u64) -> Whole {
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    let frac = frac.trim_end_matches('0');
    // 10^39 overflows a u128; a fraction that long (once trailing zeros are gone) is far past
    // the 7 decimal places the largest unit, 3_600_000 ms, can turn into whole milliseconds.
    let Some(scale) = u32::try_from(frac.len())
        .ok()
        .and_then(|k| 10u128.checked_pow(k))
    else {
        return Whole::No;
    };
    let frac: u128 = if frac.is_empty() {
        0
    } else {
        match frac.parse() {
            Ok(f) => f,
            Err(_) => return Whole::No,
        }
    };
    let frac_ms = match frac.checked_mul(u128::from(factor)) {
        Some(f) if f % scale == 0 => f / scale,
        Some(_) => return Whole::No,
        // frac < scale, so frac * factor < scale * factor, which only overflows for a fraction
        // too long to be whole anyway.
        None => return Whole::No,
    };
    let int: u128 = if int.is_empty() {
        0
    } else {
        match int.parse() {
            Ok(i) => i,
            Err(_) => return Whole::TooLarge,
        }
    };
    int.checked_mul(u128::from(factor))
        .and_then(|ms| ms.checked_add(frac_ms))
        .and_then(|ms| u64::try_from(ms).ok())
        .map_or(Whole::TooLarge, Whole::Ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole-number spelling a fraction error suggests, if any.
    fn suggestion(err: &str) -> Option<&str> {
        err.split_once("; write ")?
            .1
            .split_once(" instead of ")
            .map(|(s, _)| s)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2_000))]

        /// Arbitrary text: an answer, never a panic.
        #[test]
        fn any_text_gets_an_answer(s in "\\PC{0,40}|[0-9mshx. -]{0,30}") {
            let _ = parse(&s);
        }

        /// A sum of well-formed parts parses to the sum of their milliseconds.
        #[test]
        fn sums_add_up(parts in proptest::collection::vec((0u64..100_000, 0usize..4), 1..5)) {
            let text: String = parts.iter().map(|(n, u)| format!("{n}{}", UNITS[*u].0)).collect();
            let expected: u64 = parts.iter().map(|(n, u)| n * UNITS[*u].1).sum();
            proptest::prop_assert_eq!(parse(&text), Ok(Duration::from_millis(expected)));
        }

        /// A fraction that is a whole number of milliseconds is refused with a spelling that
        /// means the same duration.
        #[test]
        fn fraction_suggestions_mean_the_same(
            whole in 0u64..1_000_000,
            thousandths in 0u64..1_000,
            u in 0usize..4,
        ) {
            let (unit, factor) = UNITS[u];
            let text = format!("{whole}.{thousandths:03}{unit}");
            let err = parse(&text).expect_err("a fraction");
            proptest::prop_assert!(err.starts_with("fractions are not supported"), "{}", err);
            let exact = (thousandths * factor) % 1_000 == 0;
            proptest::prop_assert_eq!(suggestion(&err).is_some(), exact, "{}", err);
            if let Some(s) = suggestion(&err) {
                let ms = whole * factor + thousandths * factor / 1_000;
                proptest::prop_assert_eq!(parse(s), Ok(Duration::from_millis(ms)));
            }
        }

        /// What `format` writes, `parse` reads back.
        #[test]
        fn format_round_trips(ms in 0u64..=u64::MAX) {
            let d = Duration::from_millis(ms);
            proptest::prop_assert_eq!(parse(&format(d)), Ok(d));
        }
    }

    #[test]
    fn accepts_the_documented_forms() {
        assert_eq!(parse("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse("1500ms"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse("1s500ms"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse(" 5s "), Ok(Duration::from_secs(5)));
        assert_eq!(parse("0s"), Ok(Duration::ZERO));
    }

    #[test]
    fn refuses_the_rest() {
        for bad in [
            "", "30", "s", "30 s", "3.5s", "30sec", "30x", "-1s", "1d", "ms30",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(parse("99999999999999999999s").is_err());
        assert!(parse(&format!("{}h", u64::MAX / 1000)).is_err());
    }

    /// Each way of getting it wrong is named as itself, not as a missing unit.
    #[test]
    fn says_what_is_wrong() {
        let cases: &[(&str, &str)] = &[
            (
                "",
                "empty duration; write a whole number and a unit, e.g. \"30s\"",
            ),
            (
                "  ",
                "empty duration; write a whole number and a unit, e.g. \"30s\"",
            ),
            ("30", "`30` needs a unit (ms, s, m or h), e.g. \"30s\""),
            ("1m30", "`30` needs a unit (ms, s, m or h), e.g. \"30s\""),
            (
                "1.5s",
                "fractions are not supported; write 1500ms instead of 1.5s",
            ),
            (
                "1.5m",
                "fractions are not supported; write 90s instead of 1.5m",
            ),
            (
                ".5h",
                "fractions are not supported; write 30m instead of .5h",
            ),
            (
                "2.0s",
                "fractions are not supported; write 2s instead of 2.0s",
            ),
            (
                "1m0.25s",
                "fractions are not supported; write 250ms instead of 0.25s",
            ),
            (
                "1.0005s",
                "fractions are not supported, and 1.0005s is not a whole number of milliseconds",
            ),
            (
                "1.5ms",
                "fractions are not supported, and 1.5ms is not a whole number of milliseconds",
            ),
            (
                "1.5",
                "`1.5` needs a unit (ms, s, m or h), and fractions are not supported: \
                 use a whole number of a smaller unit",
            ),
            ("2 weeks", "unknown unit `weeks`; use ms, s, m or h"),
            ("2weeks", "unknown unit `weeks`; use ms, s, m or h"),
            ("30sec", "unknown unit `sec`; use ms, s, m or h"),
            ("1d", "unknown unit `d`; use ms, s, m or h"),
            ("5µs", "unknown unit `µs`; use ms, s, m or h"),
            ("1.5weeks", "unknown unit `weeks`; use ms, s, m or h"),
            (
                "30s!",
                "unexpected `s!` after `30`; expected a unit (ms, s, m or h)",
            ),
            (
                "30 s",
                "spaces are not allowed inside a duration; write \"30s\"",
            ),
            (
                "1m 30s",
                "spaces are not allowed inside a duration; write \"1m30s\"",
            ),
            ("-1s", "a duration cannot be negative"),
            ("ms30", "`ms` needs a number before it, e.g. \"30ms\""),
            ("s", "`s` needs a number before it, e.g. \"30s\""),
            (
                "99999999999999999999s",
                "`99999999999999999999s` is too large: a duration counts milliseconds in a u64",
            ),
            (
                "18446744073709552s",
                "`18446744073709552s` is too large: a duration counts milliseconds in a u64",
            ),
            (
                "18446744073709551615ms1ms",
                "the sum is too large: a duration counts milliseconds in a u64",
            ),
            (
                "99999999999999999999999999999999999999999.5s",
                "`99999999999999999999999999999999999999999.5s` is too large: \
                 a duration counts milliseconds in a u64",
            ),
        ];
        for (text, want) in cases {
            assert_eq!(
                parse(text).as_ref().map_err(String::as_str),
                Err(*want),
                "{text:?}"
            );
        }
        let err = parse("#5s").expect_err("no number");
        assert!(err.starts_with("expected a number at `#5s`"), "{err}");
    }

    #[test]
    fn formats_in_the_largest_whole_unit() {
        assert_eq!(format(Duration::from_millis(10)), "10ms");
        assert_eq!(format(Duration::from_millis(1500)), "1500ms");
        assert_eq!(format(Duration::from_secs(90)), "90s");
        assert_eq!(format(Duration::from_secs(120)), "2m");
        assert_eq!(format(Duration::from_secs(24 * 3600)), "24h");
        assert_eq!(format(Duration::ZERO), "0s");
    }
}
