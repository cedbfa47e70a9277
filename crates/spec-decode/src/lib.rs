//! eyrie-spec-decode: EAGLE-3 drafting and lossless verification (issue 5; nothing implemented yet).
