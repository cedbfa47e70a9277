//! eyrie-spec-decode
