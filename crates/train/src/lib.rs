//! eyrie-train
