//! Element types of safetensors tensors.

use std::fmt;

/// A safetensors element type. The names are the header's dtype strings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)]
pub enum Dtype {
    /// Boolean, one byte.
    BOOL,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 16-bit integer.
    U16,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 32-bit integer.
    U32,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 64-bit integer.
    U64,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
    /// FP8 E4M3 (the `fn` variant: no infinities, 0x7F/0xFF are NaN).
    F8_E4M3,
    /// FP8 E5M2.
    F8_E5M2,
}

impl Dtype {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Dtype::BOOL | Dtype::U8 | Dtype::I8 | Dtype::F8_E4M3 | Dtype::F8_E5M2 => 1,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::I64 | Dtype::U64 | Dtype::F64 => 8,
        }
    }

    /// The header string (`"BF16"`, `"F8_E4M3"`, ...).
    pub const fn as_str(self) -> &'static str {
        match self {
            Dtype::BOOL => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::F8_E4M3 => "F8_E4M3",
            Dtype::F8_E5M2 => "F8_E5M2",
        }
    }

    /// Parses a header dtype string; `None` for one this crate does not know.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "BOOL" => Dtype::BOOL,
            "U8" => Dtype::U8,
            "I8" => Dtype::I8,
            "I16" => Dtype::I16,
            "U16" => Dtype::U16,
            "I32" => Dtype::I32,
            "U32" => Dtype::U32,
            "I64" => Dtype::I64,
            "U64" => Dtype::U64,
            "F16" => Dtype::F16,
            "BF16" => Dtype::BF16,
            "F32" => Dtype::F32,
            "F64" => Dtype::F64,
            "F8_E4M3" => Dtype::F8_E4M3,
            "F8_E5M2" => Dtype::F8_E5M2,
            _ => return None,
        })
    }

    /// Whether this is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(self, Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64 | Dtype::F8_E4M3 | Dtype::F8_E5M2)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_round_trips_every_dtype() {
        for d in [
            Dtype::BOOL,
            Dtype::U8,
            Dtype::I8,
            Dtype::I16,
            Dtype::U16,
            Dtype::I32,
            Dtype::U32,
            Dtype::I64,
            Dtype::U64,
            Dtype::F16,
            Dtype::BF16,
            Dtype::F32,
            Dtype::F64,
            Dtype::F8_E4M3,
            Dtype::F8_E5M2,
        ] {
            assert_eq!(Dtype::parse(d.as_str()), Some(d));
        }
        assert_eq!(Dtype::parse("bf16"), None);
        assert_eq!(Dtype::parse("Q4_K"), None);
    }
}
