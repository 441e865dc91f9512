//! Human durations in attribute arguments, parsed at compile time: `"30s"`, `"1500ms"`, `"2m"`,
//! `"1h"`, and sums of them such as `"1m30s"`.

use std::time::Duration;

/// The units accepted, longest suffix first so that `ms` is not read as `m` followed by `s`.
const UNITS: [(&str, u64); 4] = [("ms", 1), ("s", 1_000), ("m", 60_000), ("h", 3_600_000)];

/// The accepted grammar, for error messages.
pub(crate) const GRAMMAR: &str = "a whole number followed by a unit (ms, s, m, h), or a sum of them: \"30s\", \"1500ms\", \"2m\", \"1m30s\"";

/// Parses `s` into a duration, or says why it cannot.
pub(crate) fn parse(s: &str) -> Result<Duration, String> {
    let text = s.trim();
    if text.is_empty() {
        return Err(format!("empty duration: expected {GRAMMAR}"));
    }
    let mut rest = text;
    let mut total_ms: u64 = 0;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(format!("invalid duration `{s}`: expected {GRAMMAR}"));
        }
        let (number, tail) = rest.split_at(digits);
        let Some((unit, factor)) = UNITS.iter().find(|(u, _)| {
            tail.starts_with(u) && !tail[u.len()..].starts_with(|c: char| c.is_ascii_alphabetic())
        }) else {
            return Err(format!(
                "invalid duration `{s}`: `{number}` needs a unit (ms, s, m, h), e.g. \"{number}s\""
            ));
        };
        let value: u64 = number
            .parse()
            .map_err(|_| format!("invalid duration `{s}`: `{number}` is too large"))?;
        total_ms = value
            .checked_mul(*factor)
            .and_then(|ms| total_ms.checked_add(ms))
            .ok_or_else(|| format!("invalid duration `{s}`: too large"))?;
        rest = &tail[unit.len()..];
    }
    Ok(Duration::from_millis(total_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2_000))]

        /// Arbitrary text: an answer, never a panic.
        #[test]
        fn any_text_gets_an_answer(s in "\\PC{0,40}|[0-9mshx ]{0,30}") {
            let _ = parse(&s);
        }

        /// A sum of well-formed parts parses to the sum of their milliseconds.
        #[test]
        fn sums_add_up(parts in proptest::collection::vec((0u64..100_000, 0usize..4), 1..5)) {
            let text: String = parts.iter().map(|(n, u)| format!("{n}{}", UNITS[*u].0)).collect();
            let expected: u64 = parts.iter().map(|(n, u)| n * UNITS[*u].1).sum();
            proptest::prop_assert_eq!(parse(&text), Ok(Duration::from_millis(expected)));
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
}
