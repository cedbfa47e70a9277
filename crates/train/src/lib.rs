//! eyrie-train: the EAGLE-3 drafter training pipeline (nothing implemented yet).
