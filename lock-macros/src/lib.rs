//! Attribute macros for leasehold.
//!
//! This crate is a placeholder: the `#[locked]` attribute is tracked by its own issue and is not
//! implemented yet, so it exports nothing.
