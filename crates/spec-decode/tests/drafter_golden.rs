//! The EAGLE-3 drafter forward against the PyTorch reference of `scripts/fixtures_spec.py`: three tiny drafters
//! (SpecForge layout borrowing the target's embedding; speculators layout with norm_before_residual, norm_before_fc
//! and llama3 RoPE; speculators with fc_norm and the full vocabulary), each through an extend of 6 target rows, two
//! chain steps fed with its own output, and a second extend after the chain's rows are dropped. Every pre-norm
//! output and logit row within `max|a-b| / max|b| <= 1e-4`.

mod common;

use burn::backend::Flex;
use eyrie_model::DeepseekV3;
use eyrie_model::quant::SafetensorsFile;
use eyrie_spec_decode::{AuxConvention, DraftFormat, Eagle3Config, Eagle3Drafter};

use common::{fixture, host, ids, matrix, scaled_error, values};

const TOL: f32 = 1e-4;

fn check(name: &str, format: DraftFormat, capture: &[usize]) -> f32 {
    let device = Default::default();
    let target = DeepseekV3::<Flex>::load(fixture("model/yarn_qlora"), &device).unwrap();
    let reference = SafetensorsFile::open(fixture("spec/reference.safetensors")).unwrap();
    let dir = fixture(&format!("spec/{name}"));
    assert_eq!(Eagle3Config::from_dir(&dir).unwrap().format, format);
    let drafter = Eagle3Drafter::load(&dir, &target, format.default_convention(), &device).unwrap();
    assert_eq!(drafter.capture_ids, capture, "{name}");
    let d2t: Vec<u32> = ids(&reference, &format!("{name}.d2t_abs"));
    assert_eq!(drafter.draft_to_target(), &d2t[..], "{name}: d2t");

    let mut worst = 0.0f32;
    let mut cmp = |what: &str, got: Vec<f32>, want: Vec<f32>| {
        let e = scaled_error(&got, &want);
        assert!(e <= TOL, "{name} {what}: scaled error {e:e} > {TOL:e}");
        worst = worst.max(e);
    };
    let mut state = drafter.new_state();
    let out = drafter
        .extend(
            &mut state,
            &ids(&reference, &format!("{name}.tokens")),
            matrix(&reference, &format!("{name}.features")),
        )
        .unwrap();
    cmp("prenorm", host(out.clone()), values(&reference, &format!("{name}.prenorm")));
    cmp("logits", host(drafter.draft_logits(out)), values(&reference, &format!("{name}.logits")));

    // The first draft distribution is the last row's logits mapped to target ids.
    let want_logits = values(&reference, &format!("{name}.logits"));
    let dv = d2t.len();
    let last = &want_logits[want_logits.len() - dv..];
    let mapped = state.next_logits().unwrap().to_vec();
    for (d, &t) in d2t.iter().enumerate() {
        assert!((mapped[t as usize] - last[d]).abs() <= TOL * last.iter().fold(0.0f32, |m, v| m.max(v.abs())));
    }
    assert_eq!(mapped.iter().filter(|v| v.is_finite()).count(), dv);

    let chain = ids(&reference, &format!("{name}.chain_tokens"));
    let want_pre = values(&reference, &format!("{name}.chain_prenorm"));
    let want_log = values(&reference, &format!("{name}.chain_logits"));
    let h = drafter.config.hidden_size;
    for (j, &t) in chain.iter().enumerate() {
        // The reference chains greedily: its token is the argmax of the previous distribution.
        assert_eq!(eyrie_model::sampling::argmax(state.next_logits().unwrap()), t, "{name}: chain token {j}");
        drafter.step(&mut state, t).unwrap();
        let got = state.next_logits().unwrap();
        let got_draft: Vec<f32> = d2t.iter().map(|&t| got[t as usize]).collect();
        cmp(&format!("chain logits {j}"), got_draft, want_log[j * dv..(j + 1) * dv].to_vec());
        cmp(
            &format!("chain prenorm {j}"),
            host(state.last_hidden().unwrap().clone()),
            want_pre[j * h..(j + 1) * h].to_vec(),
        );
    }
    assert_eq!(state.len(), 6 + chain.len());
    let out2 = drafter
        .extend(
            &mut state,
            &ids(&reference, &format!("{name}.tokens2")),
            matrix(&reference, &format!("{name}.features2")),
        )
        .unwrap();
    assert_eq!((state.len(), state.committed()), (9, 9));
    cmp("prenorm2", host(out2.clone()), values(&reference, &format!("{name}.prenorm2")));
    cmp("logits2", host(drafter.draft_logits(out2)), values(&reference, &format!("{name}.logits2")));
    println!("{name}: max scaled error {worst:e}");
    worst
}

#[test]
fn specforge_layout_matches_the_reference() {
    // No aux ids in the config: the default [2, L/2, L-3] for the 3-layer target.
    check("specforge", DraftFormat::SpecForge, &[2, 1, 0]);
}

#[test]
fn speculators_layout_matches_the_reference() {
    check("speculators", DraftFormat::Speculators, &[0, 1, 2]);
}

#[test]
fn speculators_fc_norm_full_vocab_matches_the_reference() {
    check("speculators_fcnorm", DraftFormat::Speculators, &[0, 1, 2]);
}

#[test]
fn output_of_layer_convention_shifts_ids_and_rejects_the_last_layer() {
    let device = Default::default();
    let target = DeepseekV3::<Flex>::load(fixture("model/yarn_qlora"), &device).unwrap();
    let dir = fixture("spec/speculators");
    // ids [0, 1, 2] read as SGLang's output-of-layer ids: 2 is the last layer's output, which is not captured.
    let err = Eagle3Drafter::load(&dir, &target, AuxConvention::OutputOfLayer, &device).unwrap_err().to_string();
    assert!(err.contains("eagle_aux_hidden_state_layer_ids") && err.contains("aux layer id 2"), "{err}");
}

#[test]
fn batched_extend_and_steps_equal_one_by_one() {
    let device = Default::default();
    let target = DeepseekV3::<Flex>::load(fixture("model/yarn_qlora"), &device).unwrap();
    let reference = SafetensorsFile::open(fixture("spec/reference.safetensors")).unwrap();
    let drafter =
        Eagle3Drafter::load(fixture("spec/speculators"), &target, AuxConvention::InputOfLayer, &device).unwrap();
    let (t1, f1) = (ids(&reference, "speculators.tokens"), matrix(&reference, "speculators.features"));
    let (t2, f2) = (ids(&reference, "speculators.tokens2"), matrix(&reference, "speculators.features2"));
    let (mut a, mut b) = (drafter.new_state(), drafter.new_state());
    let (mut a1, mut b1) = (drafter.new_state(), drafter.new_state());
    let out = drafter
        .extend_batch(&mut [&mut a, &mut b], &[&t1, &t2], burn::tensor::Tensor::cat(vec![f1.clone(), f2.clone()], 0))
        .unwrap();
    let want =
        [host(drafter.extend(&mut a1, &t1, f1).unwrap()), host(drafter.extend(&mut b1, &t2, f2).unwrap())].concat();
    assert!(scaled_error(&host(out), &want) <= 1e-6);
    for step in 0..2u32 {
        drafter.step_batch(&mut [&mut a, &mut b], &[10 + step, 20 + step]).unwrap();
        drafter.step(&mut a1, 10 + step).unwrap();
        drafter.step(&mut b1, 20 + step).unwrap();
        for (x, y) in [(&a, &a1), (&b, &b1)] {
            // Only the draft vocabulary's entries are finite (the rest are -inf in both).
            let finite = |v: &[f32]| v.iter().copied().filter(|l| l.is_finite()).collect::<Vec<f32>>();
            let (got, want) = (finite(x.next_logits().unwrap()), finite(y.next_logits().unwrap()));
            assert_eq!(got.len(), 64);
            assert!(scaled_error(&got, &want) <= 1e-6, "step {step}");
        }
    }
}
