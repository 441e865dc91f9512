#![doc = include_str!("../README.md")]

pub use lock_core::*;

#[cfg(feature = "macros")]
pub use lock_macros::locked;
