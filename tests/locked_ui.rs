//! Compile errors of `#[locked]`, checked against the `.stderr` files in `tests/ui`.
//! Regenerate them after a deliberate change with `TRYBUILD=overwrite`, and review the diff.
//!
//! On an error the macro emits the item untouched beside it. Each case whose error comes from
//! the macro checks that twice over:
//! - `main` calls the item and binds the call to its written type (a `Result` for the plain
//!   `fn`, a future of the written output for an `async fn`), so an item emitted with another
//!   signature adds a type error;
//! - an item that is not emitted at all would not show up as "cannot find function" there, since
//!   rustc hides those for names that a failed attribute could have defined. So each case
//!   imports a name (usually `Error`) that only the annotated items use: a dropped item adds an
//!   "unused import" warning, which the `.stderr` does not expect.
#![cfg(feature = "macros")]

#[test]
fn compile_errors() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
    // Cases that must compile and run.
    t.pass("tests/ui-pass/*.rs");
}
