#![doc = include_str!("../README.md")]

pub use lock_core::*;
