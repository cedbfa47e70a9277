//! `check_conventions` end to end on the tiny models: a drafter without aux ids gives the same layers (and the same
//! acceptance) under both conventions; one whose ids include the last layer loads only under input-of-layer,
//! which is then the best fit.

mod common;

use burn::backend::Flex;
use eyrie_model::DeepseekV3;
use eyrie_spec_decode::{AuxConvention, best_convention, check_conventions};

use common::fixture;

#[test]
fn conventions_are_compared_on_the_tiny_models() {
    let device = Default::default();
    let target = DeepseekV3::<Flex>::load(fixture("model/yarn_qlora"), &device).unwrap();
    let prompts = vec![vec![1, 17, 200, 45], vec![5, 250, 64, 31, 77]];

    let checks = check_conventions(fixture("spec/specforge"), &target, &prompts, 2, 6, &device).unwrap();
    assert_eq!(checks.len(), 2);
    assert_eq!(checks[0].capture_ids, checks[1].capture_ids);
    assert_eq!(checks[0].stats.as_ref().unwrap().emitted, checks[1].stats.as_ref().unwrap().emitted);
    assert_eq!(best_convention(&checks), None);

    let checks = check_conventions(fixture("spec/speculators"), &target, &prompts, 2, 6, &device).unwrap();
    assert_eq!(checks[0].convention, AuxConvention::InputOfLayer);
    assert_eq!(checks[0].capture_ids, Ok(vec![0, 1, 2]));
    assert!(checks[0].stats.as_ref().unwrap().steps > 0);
    let err = checks[1].capture_ids.as_ref().unwrap_err();
    assert!(err.contains("aux layer id 2"), "{err}");
    assert_eq!(best_convention(&checks), Some(AuxConvention::InputOfLayer));
}
