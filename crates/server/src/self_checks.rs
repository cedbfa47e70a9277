//! Device self-checks of the paths written without a GPU at hand (session 14; all passed on the H200 in session
//! 15): the MHA form of prefill chunks' attention (`cuda_ops::check_mha_prefill`: against the absorbed form at the
//! model's head dimensions) and greedy picks on the device (`sampling::check_device_argmax`: against the host's
//! argmax at the model's vocabulary). Each path is turned on only when its check passes on this device and stays
//! off otherwise (the paths they replace are the ones that run then); a variable that sets a path
//! (`EYRIE_MHA_PREFILL_MIN_ROWS`, `EYRIE_DEVICE_ARGMAX`) wins over its check. A check that panics counts as failed.
//! `eyrie serve` runs both in its warm-up, `eyrie generate` the MHA one (its prompt is one prefill span). Each
//! returns its words for the startup line.

#[cfg(feature = "cuda")]
use std::panic::{AssertUnwindSafe, catch_unwind};

#[cfg(feature = "cuda")]
use burn::tensor::backend::Backend;

/// The message of a caught panic.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// `f`'s result, a panic as an error.
#[cfg(feature = "cuda")]
fn caught(f: &dyn Fn() -> Result<String, String>) -> Result<String, String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(panic) => Err(format!("panic: {}", panic_message(&*panic))),
    }
}

/// The MHA form of prefill attention: on for chunks of `MHA_PREFILL_MIN_ROWS`+ rows when its check passes on
/// `device` at `c`'s head dimensions (or as `EYRIE_MHA_PREFILL_MIN_ROWS` says).
#[cfg(feature = "cuda")]
pub(crate) fn mha_prefill<B: Backend>(device: &B::Device, c: &eyrie_model::ModelConfig) -> String {
    use eyrie_model::cuda_ops::{
        MHA_PREFILL_MIN_ROWS, MlaDims, check_mha_prefill, enable_mha_prefill, mha_prefill_env_set, mha_prefill_min_rows,
    };
    if mha_prefill_env_set() {
        return match mha_prefill_min_rows() {
            Some(rows) => format!("MHA prefill attention on for chunks of {rows}+ rows (EYRIE_MHA_PREFILL_MIN_ROWS)"),
            None => "MHA prefill attention off (EYRIE_MHA_PREFILL_MIN_ROWS)".into(),
        };
    }
    let dims = MlaDims {
        heads: c.num_heads,
        nope: c.qk_nope_head_dim,
        rot: c.qk_rope_head_dim,
        vd: c.v_head_dim,
        r: c.kv_lora_rank,
    };
    match caught(&|| check_mha_prefill::<B>(device, dims).map(|e| format!("{e:.1e}"))) {
        Ok(e) => {
            enable_mha_prefill(MHA_PREFILL_MIN_ROWS);
            format!(
                "MHA prefill attention checked against the absorbed form (difference {e}), on for chunks of \
                 {MHA_PREFILL_MIN_ROWS}+ rows"
            )
        }
        Err(e) => format!("MHA prefill attention off ({e})"),
    }
}

/// Greedy picks on the device: on when its check passes on `device` at `vocab` (or as `EYRIE_DEVICE_ARGMAX` says).
#[cfg(feature = "cuda")]
pub(crate) fn device_argmax<B: Backend>(device: &B::Device, vocab: usize) -> String {
    use eyrie_model::sampling::{
        check_device_argmax, device_argmax_enabled, device_argmax_env_set, enable_device_argmax,
    };
    if device_argmax_env_set() {
        let on = if device_argmax_enabled() { "on" } else { "off" };
        return format!("greedy picks on the device {on} (EYRIE_DEVICE_ARGMAX)");
    }
    match caught(&|| check_device_argmax::<B>(device, vocab).map(|()| String::new())) {
        Ok(_) => {
            enable_device_argmax();
            "greedy picks on the device checked against the host's, on".into()
        }
        Err(e) => format!("greedy picks on the device off ({e})"),
    }
}
