//! [`DeepseekV3::load_with_progress`] reports every tensor the model takes, monotonically, ending at the totals
//! (the fixture's MTP layer, skipped by rule, is not counted).

mod common;

use burn::backend::Flex;
use common::fixture;
use eyrie_model::DeepseekV3;
use eyrie_model::weights::LoadProgress;

#[test]
fn progress_reaches_the_totals_monotonically() {
    let mut seen: Vec<LoadProgress> = Vec::new();
    let model = DeepseekV3::<Flex>::load_with_progress(fixture("yarn_qlora"), &Default::default(), |p| seen.push(*p));
    model.unwrap();
    let last = seen.last().expect("progress was reported");
    assert_eq!(last.tensors_done, last.tensors_total);
    assert_eq!(last.bytes_done, last.bytes_total);
    assert!(last.bytes_total > 0 && last.eta().is_some_and(|d| d.is_zero()));
    assert!(seen.windows(2).all(|w| w[0].bytes_done <= w[1].bytes_done && w[0].tensors_done + 1 == w[1].tensors_done));
    assert_eq!(seen.len(), last.tensors_total);
}
