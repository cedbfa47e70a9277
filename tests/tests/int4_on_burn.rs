//! Across crates: the INT4 weights that the real compressed-tensors library wrote (fixtures/quant) are loaded by
//! eyrie-quant, uploaded to a burn backend in their packed form and dequantized there by tensor ops; the result must
//! equal the library's own decompression bit for bit, as the GPU path will be checked the same way.

use std::path::Path;

use burn::backend::Flex;
use burn::tensor::DType;
use eyrie_quant::burn::Int4Tensors;
use eyrie_quant::config::{GroupSize, QuantScheme, QuantizationConfig};
use eyrie_quant::{Checkpoint, LinearWeight};
use half::bf16;

#[test]
fn library_fixture_dequantizes_on_a_burn_backend_bit_exactly() {
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/quant");
    let ckpt = Checkpoint::open(&fx).expect("fixture checkpoint opens");
    let expected = Checkpoint::open(fx.join("expected.safetensors")).expect("expected outputs open");
    let plan = QuantizationConfig::from_config_file(&fx.join("config.json"))
        .expect("config parses")
        .expect("config has a quantization_config")
        .plan()
        .expect("supported scheme");
    let device = Default::default();
    let mut checked = 0;
    for name in expected.names().filter(|n| n.ends_with(".weight")) {
        let module = name.trim_end_matches(".weight");
        let group = match plan.scheme_for(module, "Linear") {
            Some(QuantScheme::Int4Group { group_size: GroupSize::Columns(n), .. }) => Some(*n),
            Some(QuantScheme::Int4Group { group_size: GroupSize::WholeRow, .. }) => None,
            other => panic!("{module}: expected an INT4 scheme, got {other:?}"),
        };
        let LinearWeight::Int4(w) = LinearWeight::load(&ckpt, module, group).expect("linear loads") else {
            panic!("{module} is not INT4");
        };
        let on_device = Int4Tensors::<Flex>::upload(&w, &device).dequantize();
        let data = on_device.into_data();
        assert_eq!(data.dtype, DType::BF16, "{module}: BF16 scales give a BF16 weight");
        let got: Vec<u16> = data.to_vec::<bf16>().expect("bf16 data").iter().map(|x| x.to_bits()).collect();
        let want: Vec<u16> =
            expected.tensor(name).expect("expected").to_bf16_vec().expect("bf16").iter().map(|x| x.to_bits()).collect();
        assert_eq!(got, want, "{module}");
        checked += 1;
    }
    assert_eq!(checked, 6);
}
