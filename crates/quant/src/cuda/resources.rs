//! Per-kernel resource usage as ptxas reports it (`--ptxas-options=-v`), and the per-block limits of a CUDA
//! architecture that a launch must stay within: what `cargo xtask kernels` checks for each kernel specialisation.
//! Pure host code (no CUDA), tested in CI.

use std::fmt;

/// A CUDA architecture `sm_XY` (`version` = 10 X + Y, as CubeCL's `CudaArchitecture` counts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arch {
    /// 10 * major + minor (120 for SM120, the RTX PRO 6000 Blackwell; 90 for the H200).
    pub version: u32,
}

impl Arch {
    /// Parses `sm_120`, `sm_120a`, `compute_90` or `120`.
    pub fn parse(s: &str) -> Option<Self> {
        let digits = s.trim().trim_start_matches("sm_").trim_start_matches("compute_").trim_end_matches(['a', 'f']);
        let version: u32 = digits.parse().ok()?;
        (30..=200).contains(&version).then_some(Self { version })
    }

    /// The NVRTC/nvcc target CubeCL compiles for on this architecture: `sm_XYa` from sm_90 on (arch-specific
    /// features), `sm_XY` before (cubecl-cuda 0.10, `compute/context.rs`).
    pub fn nvrtc_target(&self) -> String {
        if self.version >= 90 { format!("sm_{}a", self.version) } else { format!("sm_{}", self.version) }
    }

    /// Most shared memory one block may use (static + dynamic, with the opt-in that CubeCL sets), in bytes: the
    /// `sharedMemPerBlockOptin` of the CUDA programming guide's table of compute capabilities.
    pub fn max_shared_per_block(&self) -> usize {
        let kib = match self.version {
            70..=72 => 96,
            75 => 64,
            80 | 87 => 163,
            86 | 89 => 99,
            90 | 100 | 101 | 103 | 110 => 227,
            // 12.x (RTX 50, RTX PRO Blackwell, DGX Spark): 100 KiB per SM, 99 KiB per block.
            120 | 121 => 99,
            _ => 48,
        };
        kib * 1024
    }

    /// Most 32-bit registers one block may use (64 K on every architecture since sm_50).
    pub fn max_registers_per_block(&self) -> usize {
        64 * 1024
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}", self.version)
    }
}

/// One entry function's resources as ptxas reports them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PtxasUsage {
    /// Entry function (mangled name as in the PTX).
    pub function: String,
    /// Registers per thread.
    pub registers: usize,
    /// Static shared memory per block, bytes (dynamic shared memory is the launch's, not in the log).
    pub static_smem: usize,
    /// Bytes of stack frame per thread.
    pub stack_frame: usize,
    /// Bytes spilled to local memory (stores) and read back (loads) per thread.
    pub spill_stores: usize,
    /// See `spill_stores`.
    pub spill_loads: usize,
    /// Named barriers used.
    pub barriers: usize,
}

/// `N` in `"... N <unit>..."` for the first segment of `line` (split at commas) that contains `unit`.
fn number_before(line: &str, unit: &str) -> Option<usize> {
    line.split(',').find_map(|seg| {
        let pos = seg.find(unit)?;
        seg[..pos].split_whitespace().last()?.parse().ok()
    })
}

/// The entry functions of a ptxas `-v` log (NVRTC's program log with `--ptxas-options=-v`), in log order.
///
/// Recognised lines: `Compiling entry function 'NAME' for 'sm_XY'` (starts an entry), `N bytes stack frame, N
/// bytes spill stores, N bytes spill loads` and `Used N registers, used N barriers, N bytes smem, N bytes
/// cmem[0]`; a function with no smem clause uses none. Other lines (gmem, compile time) are ignored.
pub fn parse_ptxas_log(log: &str) -> Vec<PtxasUsage> {
    let mut out: Vec<PtxasUsage> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default();
            out.push(PtxasUsage { function: name.to_string(), ..Default::default() });
            continue;
        }
        let Some(cur) = out.last_mut() else { continue };
        if line.contains("stack frame") {
            cur.stack_frame = number_before(line, "bytes stack frame").unwrap_or(0);
            cur.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
            cur.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
        } else if line.contains("Used ") && line.contains("registers") {
            cur.registers = number_before(line, "registers").unwrap_or(0);
            cur.barriers = number_before(line, "barriers").unwrap_or(0);
            cur.static_smem = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    out
}

/// Error lines of a compiler log (`error` as ptxas and NVRTC write it). Warnings are not errors: NVRTC warns
/// about CubeCL's generated code (sign conversions, unused variables) on every kernel.
pub fn log_errors(log: &str) -> Vec<&str> {
    log.lines().filter(|l| l.to_ascii_lowercase().contains("error")).collect()
}

/// What one launch of a kernel specialisation needs per block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockNeeds {
    /// Threads per block.
    pub threads: usize,
    /// Dynamic shared memory the launch asks for (CubeCL gathers all of a kernel's shared memory there), bytes.
    pub dynamic_smem: usize,
}

/// Why a specialisation cannot launch on an architecture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitError {
    /// Static + dynamic shared memory above the architecture's per-block maximum.
    SharedMemory {
        /// Bytes the block needs.
        needed: usize,
        /// The architecture's maximum.
        max: usize,
    },
    /// Registers per thread times threads per block above the register file a block may use.
    Registers {
        /// Registers the block needs.
        needed: usize,
        /// The architecture's maximum.
        max: usize,
    },
}

impl fmt::Display for LimitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::SharedMemory { needed, max } => write!(
                f,
                "needs {needed} bytes ({:.1} KiB) of shared memory per block, the limit is {max} ({} KiB)",
                *needed as f64 / 1024.0,
                max / 1024
            ),
            Self::Registers { needed, max } => {
                write!(f, "needs {needed} registers per block, the limit is {max}")
            }
        }
    }
}

/// Checks a compiled specialisation against `arch`'s per-block limits; all violations, empty when it fits.
pub fn check_limits(arch: Arch, usage: &PtxasUsage, needs: &BlockNeeds) -> Vec<LimitError> {
    let mut errors = Vec::new();
    let smem = usage.static_smem + needs.dynamic_smem;
    if smem > arch.max_shared_per_block() {
        errors.push(LimitError::SharedMemory { needed: smem, max: arch.max_shared_per_block() });
    }
    let regs = usage.registers * needs.threads;
    if regs > arch.max_registers_per_block() {
        errors.push(LimitError::Registers { needed: regs, max: arch.max_registers_per_block() });
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC 12.8's log for two entries (`--ptxas-options=-v`, sm_120a), one with a spill written by hand in the
    /// format ptxas prints.
    const LOG: &str = "\
ptxas info    : Overriding maximum register limit 256 for 'k3' with  24 of maxrregcount option
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k3' for 'sm_120a'
ptxas info    : Function properties for k3
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers
ptxas info    : Compile time = 3.804 ms
ptxas info    : Compiling entry function 'expert_rows_kernel_f_bf16_n_4' for 'sm_120a'
ptxas info    : Function properties for expert_rows_kernel_f_bf16_n_4
ptxas         .     96 bytes stack frame, 88 bytes spill stores, 120 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 4096 bytes smem, 380 bytes cmem[0]
ptxas info    : Compile time = 22.873 ms
";

    #[test]
    fn parses_registers_smem_and_spills_per_entry() {
        let u = parse_ptxas_log(LOG);
        assert_eq!(u.len(), 2);
        assert_eq!(
            u[0],
            PtxasUsage { function: "k3".into(), registers: 8, ..Default::default() },
            "a function without an smem clause uses none"
        );
        assert_eq!(
            u[1],
            PtxasUsage {
                function: "expert_rows_kernel_f_bf16_n_4".into(),
                registers: 255,
                static_smem: 4096,
                stack_frame: 96,
                spill_stores: 88,
                spill_loads: 120,
                barriers: 1,
            }
        );
    }

    #[test]
    fn empty_or_foreign_logs_give_no_entries() {
        assert!(parse_ptxas_log("").is_empty());
        assert!(parse_ptxas_log("ptxas info    : Used 8 registers\nnothing else").is_empty());
    }

    #[test]
    fn finds_error_lines_not_warnings() {
        let log = "k.cu(2): error: identifier \"x\" is undefined\nptxas info    : 0 bytes gmem\n\
                   k.cu(78): warning #177-D: variable \"l_11\" was declared but never referenced\n\
                   ptxas error   : Entry function 'k' uses too much shared data (0x1f800 bytes, 0xc000 max)";
        assert_eq!(log_errors(log).len(), 2);
        assert!(log_errors(LOG).is_empty());
    }

    #[test]
    fn arch_parsing_targets_and_limits() {
        let sm120 = Arch::parse("sm_120").unwrap();
        assert_eq!(sm120, Arch::parse("120").unwrap());
        assert_eq!(sm120, Arch::parse("sm_120a").unwrap());
        assert_eq!(sm120.nvrtc_target(), "sm_120a");
        assert_eq!(sm120.max_shared_per_block(), 99 * 1024);
        assert_eq!(Arch::parse("sm_90").unwrap().max_shared_per_block(), 227 * 1024);
        assert_eq!(Arch::parse("sm_86").unwrap().nvrtc_target(), "sm_86");
        assert!(Arch::parse("sm_x").is_none() && Arch::parse("sm_7").is_none());
    }

    #[test]
    fn the_99_kib_limit_of_sm120_is_enforced() {
        let arch = Arch::parse("sm_120").unwrap();
        let usage = PtxasUsage { registers: 64, ..Default::default() };
        // The gate/up kernel at Kimi-K2's hidden 7168 with 4 tokens per pass: 4 * (1792 + 224) 16-byte vectors.
        let tb4 = BlockNeeds { threads: 256, dynamic_smem: 4 * (7168 / 4 + 7168 / 32) * 16 };
        let errors = check_limits(arch, &usage, &tb4);
        assert_eq!(errors, vec![LimitError::SharedMemory { needed: 129_024, max: 101_376 }]);
        assert!(errors[0].to_string().contains("126.0 KiB"), "{}", errors[0]);
        // Exactly 99 KiB fits; one byte more does not (static shared memory counts too).
        let at = BlockNeeds { threads: 256, dynamic_smem: 99 * 1024 - 16 };
        assert!(check_limits(arch, &PtxasUsage { static_smem: 16, ..usage.clone() }, &at).is_empty());
        assert_eq!(check_limits(arch, &PtxasUsage { static_smem: 17, ..usage.clone() }, &at).len(), 1);
        // The same block fits the H200.
        assert!(check_limits(Arch::parse("sm_90").unwrap(), &usage, &tb4).is_empty());
    }

    #[test]
    fn register_file_per_block_is_enforced() {
        let arch = Arch::parse("sm_90").unwrap();
        let needs = BlockNeeds { threads: 512, dynamic_smem: 0 };
        assert!(check_limits(arch, &PtxasUsage { registers: 128, ..Default::default() }, &needs).is_empty());
        assert_eq!(
            check_limits(arch, &PtxasUsage { registers: 130, ..Default::default() }, &needs),
            vec![LimitError::Registers { needed: 66_560, max: 65_536 }]
        );
    }
}
