//! `eyrie dequant`: one Linear's weight, dequantized to bf16, written as a safetensors file.

use std::path::Path;

use anyhow::{Result, bail};
use eyrie_model::device::{DeviceChoice, ResolvedDevice};
use eyrie_quant::config::{GroupSize, QuantScheme, QuantizationConfig};
use eyrie_quant::{Checkpoint, LinearWeight, SafetensorsWriter};
use half::bf16;

pub fn run(dir: &Path, name: &str, out: &Path, device: DeviceChoice) -> Result<()> {
    let module = ["weight_packed", "weight"]
        .iter()
        .find_map(|s| name.strip_suffix(&format!(".{s}")))
        .unwrap_or(name)
        .to_string();
    let ckpt = Checkpoint::open(dir)?;
    let group = group_size_for(dir, &module)?;
    let weight = LinearWeight::load(&ckpt, &module, group)?;
    let [o, i] = weight.shape();
    let values = weight.dequantize_bf16()?;
    let device = device.resolve()?;
    if let ResolvedDevice::Cuda(index) = device {
        check_on_cuda(&weight, &values, index)?;
    }
    let mut w = SafetensorsWriter::new();
    w.metadata("source", format!("{} ({})", dir.display(), weight.kind().as_str()));
    w.add_bf16(format!("{module}.weight"), &[o, i], &values)?;
    w.write(out)?;
    eprintln!("wrote {module}.weight [{o}, {i}] BF16 ({}) to {} on {device}", weight.kind().as_str(), out.display());
    Ok(())
}

/// The INT4 group size for `module` from config.json's quantization config, when there is one.
fn group_size_for(dir: &Path, module: &str) -> Result<Option<usize>> {
    let path = if dir.is_dir() { dir.join("config.json") } else { dir.with_file_name("config.json") };
    if !path.exists() {
        return Ok(None);
    }
    let Some(cfg) = QuantizationConfig::from_config_file(&path)? else { return Ok(None) };
    let plan = cfg.plan()?;
    Ok(match plan.scheme_for(module, "Linear") {
        Some(QuantScheme::Int4Group { group_size: GroupSize::Columns(n), .. }) => Some(*n),
        _ => None,
    })
}

#[cfg(feature = "cuda")]
fn check_on_cuda(weight: &LinearWeight<'_>, reference: &[bf16], index: usize) -> Result<()> {
    use burn::backend::Cuda;
    use burn::backend::cuda::CudaDevice;
    use eyrie_quant::burn::Int4Tensors;

    let LinearWeight::Int4(w) = weight else {
        eprintln!("note: {} weights need no device dequantization; wrote the host result", weight.kind().as_str());
        return Ok(());
    };
    let dev = CudaDevice::new(index);
    let t = Int4Tensors::<Cuda>::upload(w, &dev).dequantize();
    let data = t.into_data().convert::<bf16>();
    let got = data.as_slice::<bf16>().map_err(|e| anyhow::anyhow!("reading back the device result: {e:?}"))?;
    let diff = got.iter().zip(reference).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    if diff != 0 {
        bail!("cuda:{index} dequantization differs from the CPU reference in {diff} of {} values", reference.len());
    }
    eprintln!("cuda:{index}: device dequantization is bit-identical to the CPU reference ({} values)", got.len());
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn check_on_cuda(_: &LinearWeight<'_>, _: &[bf16], _: usize) -> Result<()> {
    bail!("this binary was built without CUDA support")
}
