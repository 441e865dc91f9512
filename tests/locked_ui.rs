//! Compile errors of `#[locked]`, checked against the `.stderr` files in `tests/ui`.
//! Regenerate them after a deliberate change with `TRYBUILD=overwrite`, and review the diff.
#![cfg(feature = "macros")]

#[test]
fn compile_errors() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
