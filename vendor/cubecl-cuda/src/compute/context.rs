use cubecl_common::backtrace::BackTrace;
use cubecl_cpp::formatter::format_cpp;
use cubecl_cpp::{cuda::arch::CudaArchitecture, shared::CompilationOptions};
use cubecl_runtime::{
    compiler::CompilationError,
    validation::{validate_cube_dim, validate_units},
};

use super::storage::gpu::GpuResource;
use crate::{CudaCompiler, compute::stream::Stream};
use crate::{
    CudaComputeKernel,
    install::{cccl_include_path, include_path},
};
use cubecl_core::{
    compilation_cache::CompilationCache,
    hash::StableHash,
    server::ResourceLimitError,
    {ir::DeviceProperties, prelude::*},
};
use cubecl_runtime::timestamp_profiler::TimestampProfiler;
use cubecl_runtime::{compiler::CubeTask, logging::ServerLogger};
use cudarc::driver::DriverError;
use cudarc::driver::sys::CUfunc_st;
use cudarc::driver::sys::{CUctx_st, CUfunction_attribute, CUtensorMap};
use std::collections::HashMap;
use std::ffi::CString;
use std::ffi::c_char;
use std::str::FromStr;
use std::sync::Arc;
use std::{ffi::CStr, os::raw::c_void};

use cubecl_common::cache::CacheOption;

#[derive(Debug)]
pub(crate) struct CudaContext {
    pub context: *mut CUctx_st,
    pub module_names: HashMap<KernelId, CompiledKernel>,
    ptx_cache: Option<CompilationCache<StableHash, PtxCacheEntry>>,
    pub timestamps: TimestampProfiler,
    pub arch: CudaArchitecture,
    pub compilation_options: CompilationOptions,
    pub properties: DeviceProperties,
}

#[derive(Debug)]
pub struct CompiledKernel {
    cube_dim: CubeDim,
    shared_mem_bytes: usize,
    func: *mut CUfunc_st,
    /// Eyrie patch: the kernel waits for the previous grid at its entry (`griddepcontrol.wait`, found in its PTX),
    /// so it may be launched as a programmatic dependent launch.
    pdl: bool,
    /// Eyrie patch: the entry point's name, for the stream trace (`eyrie_trace`).
    name: String,
}

/// Eyrie patch: programmatic dependent launch (PDL, sm_90 and later). Each kernel compiled here starts by waiting
/// for the grid before it in the stream to complete and flush its memory (`griddepcontrol.wait`), then lets the next
/// grid be scheduled (`griddepcontrol.launch_dependents`); it is launched with the programmatic stream serialization
/// attribute, so its blocks are scheduled while the previous grid's last blocks run instead of after the grid ends.
/// Memory order is the stream's as before: no instruction of a kernel runs before its predecessor completes. On by
/// default; `EYRIE_PDL=0` turns it off (no wait compiled in, plain launches) for comparisons.
fn pdl_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("EYRIE_PDL").map(|v| v != "0").unwrap_or(true))
}

/// Eyrie patch: whether a kernel's `// EYRIE_PDL_WAIT` markers place its wait (see [`eyrie_source_rewrite`]); on by
/// default, `EYRIE_PDL_LATE=0` keeps the wait at the entry instead (for comparisons).
fn pdl_late_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("EYRIE_PDL_LATE").map(|v| v != "0").unwrap_or(true))
}

/// Eyrie patch: whether every launch sets its function's dynamic shared memory size again (upstream's way; off
/// by default: it is set once when the function is loaded). `EYRIE_FUNC_ATTR_EACH_LAUNCH=1` turns it on.
fn func_attr_each_launch() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("EYRIE_FUNC_ATTR_EACH_LAUNCH").is_ok_and(|v| v == "1"))
}

/// Marker (a CubeCL `comment!`) for the PDL wait: a kernel holding one waits for its predecessor there instead of
/// at its entry. Every read of what the launch before it wrote, and every write, must come after a marker on the
/// same thread; before it only reads of buffers written two or more launches back (or never) are allowed. A thread
/// that reaches no marker does not wait, so a kernel should also pass one on every path to its end (its completion
/// then implies its predecessor's, as with the entry wait).
pub const EYRIE_PDL_WAIT: &str = "// EYRIE_PDL_WAIT";

const PDL_WAIT_ASM: &str = "asm volatile(\"griddepcontrol.wait;\" ::: \"memory\");";
const PDL_TRIGGER_ASM: &str = "asm volatile(\"griddepcontrol.launch_dependents;\");";

/// Eyrie patch: the generated CUDA source as NVRTC gets it. With `pdl` (sm_90 and later, see `pdl_enabled`) the
/// kernel's body (the first `{` after `__global__`: CubeCL's CUDA dialect writes no brace in an entry point's
/// launch bounds or parameters) starts by
/// letting the next grid be scheduled (`griddepcontrol.launch_dependents`) and by waiting for the previous one
/// (`griddepcontrol.wait`), unless the source has [`EYRIE_PDL_WAIT`] markers, which then become the waits. Without
/// `pdl` the wait markers stay comments. Also used by the offline compiles (eyrie-quant's `cuda::offline`), so
/// that they compile what the device runs.
pub fn eyrie_source_rewrite(source: &str, pdl: bool) -> String {
    let mut out = source.to_string();
    if !pdl {
        return out;
    }
    let late = pdl_late_enabled() && out.contains(EYRIE_PDL_WAIT);
    if late {
        out = out.replace(EYRIE_PDL_WAIT, PDL_WAIT_ASM);
    }
    let Some(entry) = out.find("__global__") else { return out };
    let Some(brace) = out[entry..].find('{') else { return out };
    let body = entry + brace + 1;
    let prologue = if late {
        format!("\n{PDL_TRIGGER_ASM}\n")
    } else {
        format!("\n{PDL_WAIT_ASM}\n{PDL_TRIGGER_ASM}\n")
    };
    out.insert_str(body, &prologue);
    out
}

#[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq, Clone)]
pub struct PtxCacheEntry {
    entrypoint_name: String,
    shared_mem_bytes: usize,
    ptx: Vec<std::ffi::c_char>,
}

impl CudaContext {
    pub fn new(
        compilation_options: CompilationOptions,
        properties: DeviceProperties,
        context: *mut CUctx_st,
        arch: CudaArchitecture,
    ) -> Self {
        Self {
            context,
            module_names: HashMap::new(),
            ptx_cache: {
                use cubecl_runtime::config::RuntimeConfig;
                let config = cubecl_runtime::config::CubeClRuntimeConfig::get();
                if let Some(cache) = &config.compilation.cache {
                    let root = cache.root();
                    Some(CompilationCache::new(
                        "ptx",
                        CacheOption::default().name("cuda").root(root),
                    ))
                } else {
                    None
                }
            },
            arch,
            timestamps: TimestampProfiler::default(),
            compilation_options,
            properties,
        }
    }

    /// Switches the current CUDA context to this context.
    pub fn unsafe_set_current(&self) -> Result<(), DriverError> {
        // SAFETY: `self.context` is a valid CUDA context obtained from `primary_ctx::retain`
        // during server initialization and remains valid for the server's lifetime.
        unsafe { cudarc::driver::result::ctx::set_current(self.context) }
    }

    pub fn compile_kernel(
        &mut self,
        kernel_id: &KernelId,
        kernel: Box<dyn CubeTask<CudaCompiler>>,
        mode: ExecutionMode,
        logger: Arc<ServerLogger>,
    ) -> Result<(), LaunchError> {
        let hash = if let Some(cache) = &self.ptx_cache {
            let hash = kernel_id.stable_hash();

            if let Some(entry) = cache.get(&hash) {
                log::trace!("Using PTX cache");

                self.load_ptx(
                    entry.ptx.clone(),
                    kernel_id.clone(),
                    entry.entrypoint_name.clone(),
                    kernel_id.cube_dim,
                    entry.shared_mem_bytes,
                )?;
                return Ok(());
            }
            Some(hash)
        } else {
            None
        };

        log::trace!("Compiling kernel");

        validate_cube_dim(&self.properties, kernel_id)?;
        validate_units(&self.properties, kernel_id)?;

        let mut kernel_compiled = kernel.compile(
            &mut Default::default(),
            &self.compilation_options,
            mode,
            kernel.address_type(),
        )?;

        self.validate_shared(&kernel_compiled.repr)?;

        if logger.compilation_activated() {
            kernel_compiled.debug_info = Some(DebugInformation::new("cpp", kernel_id.clone()));

            if let Ok(formatted) = format_cpp(&kernel_compiled.source) {
                kernel_compiled.source = formatted;
            }
        }

        // Eyrie patch: markers and the PDL prologue (see `eyrie_source_rewrite`).
        kernel_compiled.source =
            eyrie_source_rewrite(&kernel_compiled.source, self.arch.version >= 90 && pdl_enabled());

        let cube_dim = kernel_compiled.cube_dim;
        let arch = if self.arch.version >= 90 {
            format!("--gpu-architecture=sm_{}a", self.arch)
        } else {
            format!("--gpu-architecture=sm_{}", self.arch)
        };

        let include_path = include_path();
        let include_option = format!("--include-path={}", include_path.to_str().unwrap());
        let cccl_include_path = cccl_include_path();
        let cccl_include_option = format!("--include-path={}", cccl_include_path.to_str().unwrap());
        let mut options = vec![arch.as_str(), include_option.as_str(), "-lineinfo"];
        if cccl_include_path.exists() {
            options.push(&cccl_include_option);
        }

        logger.log_compilation(&kernel_compiled);

        // SAFETY: Calling NVRTC FFI to create, compile, and extract PTX from a program.
        // The `CString` source is null-terminated and outlives the program. On compilation
        // failure, the error log is retrieved and reported before returning.
        let ptx = unsafe {
            // I'd like to set the name to the kernel name, but keep getting UTF-8 errors so let's
            // leave it `None` for now
            let source = CString::from_str(&kernel_compiled.source).unwrap();
            let program =
                cudarc::nvrtc::result::create_program(source.as_c_str(), None).map_err(|err| {
                    CompilationError::Generic {
                        reason: format!("{err:?}"),
                        backtrace: BackTrace::capture(),
                    }
                })?;
            if cudarc::nvrtc::result::compile_program(program, &options).is_err() {
                let log_raw = cudarc::nvrtc::result::get_program_log(program).map_err(|err| {
                    CompilationError::Generic {
                        reason: format!("{err:?}"),
                        backtrace: BackTrace::capture(),
                    }
                })?;

                let log_ptr = log_raw.as_ptr();
                let log = CStr::from_ptr(log_ptr).to_str().unwrap();
                let mut message = "[Compilation Error] ".to_string();
                for line in log.split('\n') {
                    if !line.is_empty() {
                        message += format!("\n    {line}").as_str();
                    }
                }
                let source = kernel
                    .compile(
                        &mut Default::default(),
                        &self.compilation_options,
                        mode,
                        kernel.address_type(),
                    )?
                    .source;
                Err(CompilationError::Generic {
                    reason: format!("{message}\n[Source]  \n{source}"),
                    backtrace: BackTrace::capture(),
                })?;
            };
            cudarc::nvrtc::result::get_ptx(program).map_err(|err| CompilationError::Generic {
                reason: format!("{err:?}"),
                backtrace: BackTrace::capture(),
            })?
        };

        let repr = kernel_compiled.repr.unwrap();

        if let Some(cache) = &mut self.ptx_cache {
            let result = cache.insert(
                hash.unwrap(),
                PtxCacheEntry {
                    entrypoint_name: kernel_compiled.entrypoint_name.clone(),
                    shared_mem_bytes: repr.shared_memory_size(),
                    ptx: ptx.clone(),
                },
            );
            if let Err(err) = result {
                log::warn!("Unable to save the ptx {err:?}");
            }
        }

        self.load_ptx(
            ptx,
            kernel_id.clone(),
            kernel_compiled.entrypoint_name,
            cube_dim,
            repr.shared_memory_size(),
        )?;
        Ok(())
    }

    fn load_ptx(
        &mut self,
        ptx: Vec<c_char>,
        kernel_id: KernelId,
        entrypoint_name: String,
        cube_dim: CubeDim,
        shared_mem_bytes: usize,
    ) -> Result<(), CompilationError> {
        let name = entrypoint_name.clone();
        let func_name = CString::new(entrypoint_name).unwrap();
        // SAFETY: `ptx` is a valid null-terminated PTX binary from NVRTC. `func_name` is a
        // null-terminated `CString` matching the kernel entry point in the compiled module.
        let func = unsafe {
            let module = cudarc::driver::result::module::load_data(ptx.as_ptr() as *const _)
                .map_err(|err| CompilationError::Generic {
                    reason: format!("Unable to load the PTX: {err:?}"),
                    backtrace: BackTrace::capture(),
                })?;

            cudarc::driver::result::module::get_function(module, func_name).map_err(|err| {
                CompilationError::Generic {
                    reason: format!("Unable to fetch the function from the module: {err:?}"),
                    backtrace: BackTrace::capture(),
                }
            })?
        };

        // Eyrie patch: PDL launches only for a kernel that waits for its predecessor (a PTX from the cache may
        // predate the prologue, or come from a process with `EYRIE_PDL=0`).
        let ptx_bytes: Vec<u8> = ptx.iter().map(|&c| c as u8).collect();
        let pdl = pdl_enabled() && ptx_bytes.windows(19).any(|w| w == b"griddepcontrol.wait");
        // Eyrie patch: the function's dynamic shared memory size is set once here, not before every launch (a
        // driver call on the launching thread each time, its cost not yet measured; `EYRIE_FUNC_ATTR_EACH_LAUNCH=1`
        // restores the per-launch call, for comparisons).
        // SAFETY: `func` is the function handle just fetched from the loaded module.
        unsafe {
            cudarc::driver::result::function::set_function_attribute(
                func,
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared_mem_bytes as i32,
            )
            .map_err(|err| CompilationError::Generic {
                reason: format!("Unable to set the function's shared memory size: {err:?}"),
                backtrace: BackTrace::capture(),
            })?;
        }
        self.module_names.insert(
            kernel_id.clone(),
            CompiledKernel {
                cube_dim,
                shared_mem_bytes,
                func,
                pdl,
                name,
            },
        );

        Ok(())
    }

    pub fn execute_task(
        &mut self,
        stream: &mut Stream,
        kernel_id: KernelId,
        dispatch_count: (u32, u32, u32),
        tensor_maps: &[CUtensorMap],
        resources: &[GpuResource],
        const_info: Option<*mut c_void>,
    ) -> Result<(), LaunchError> {
        let mut bindings = tensor_maps
            .iter()
            .map(|map| map as *const _ as *mut c_void)
            .collect::<Vec<_>>();
        bindings.extend(resources.iter().map(|memory| memory.binding));
        bindings.extend(const_info);

        let kernel = self.module_names.get(&kernel_id).unwrap();
        let cube_dim = kernel.cube_dim;
        super::eyrie_trace::record(stream.sys, "launch", || {
            format!(
                "{}\tgrid {:?}\tblock ({}, {}, {})\tsmem {}\tpdl {}",
                kernel.name, dispatch_count, cube_dim.x, cube_dim.y, cube_dim.z, kernel.shared_mem_bytes, kernel.pdl
            )
        });
        // SAFETY: `kernel.func` is a valid function handle from a loaded module.
        // `stream.sys` is a valid CUDA stream. `bindings` contains valid device pointers
        // for all kernel arguments. The dispatch and cube dimensions are validated by
        // the caller.
        unsafe {
            if func_attr_each_launch() {
                cudarc::driver::result::function::set_function_attribute(
                    kernel.func,
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    kernel.shared_mem_bytes as i32,
                )
                .map_err(|err| LaunchError::Unknown {
                    reason: format!("{err:?}"),
                    backtrace: BackTrace::capture(),
                })?;
            }
            if kernel.pdl {
                // Eyrie patch: a programmatic dependent launch (see `pdl_enabled`).
                let mut attr: cudarc::driver::sys::CUlaunchAttribute = std::mem::zeroed();
                attr.id = cudarc::driver::sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                attr.value.programmaticStreamSerializationAllowed = 1;
                let config = cudarc::driver::sys::CUlaunchConfig {
                    gridDimX: dispatch_count.0,
                    gridDimY: dispatch_count.1,
                    gridDimZ: dispatch_count.2,
                    blockDimX: cube_dim.x,
                    blockDimY: cube_dim.y,
                    blockDimZ: cube_dim.z,
                    sharedMemBytes: kernel.shared_mem_bytes as u32,
                    hStream: stream.sys,
                    attrs: &mut attr,
                    numAttrs: 1,
                };
                cudarc::driver::sys::cuLaunchKernelEx(
                    &config,
                    kernel.func,
                    bindings.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
                .result()
                .map_err(|err| LaunchError::Unknown {
                    reason: format!("{err:?}"),
                    backtrace: BackTrace::capture(),
                })?;
            } else {
                cudarc::driver::result::launch_kernel(
                    kernel.func,
                    dispatch_count,
                    (cube_dim.x, cube_dim.y, cube_dim.z),
                    // Shared memory is collected into a single buffer, with each shared memory being
                    // an offset pointer
                    kernel.shared_mem_bytes as u32,
                    stream.sys,
                    &mut bindings,
                )
                .map_err(|err| LaunchError::Unknown {
                    reason: format!("{err:?}"),
                    backtrace: BackTrace::capture(),
                })?;
            }
        };

        Ok(())
    }

    fn validate_shared(&self, repr: &Option<CudaComputeKernel>) -> Result<(), LaunchError> {
        let requested = repr.as_ref().map(|repr| repr.shared_memory_size());
        let max = self.properties.hardware.max_shared_memory_size;
        if let Some(requested) = requested
            && requested > max
        {
            Err(ResourceLimitError::SharedMemory {
                requested,
                max,
                backtrace: BackTrace::capture(),
            }
            .into())
        } else {
            Ok(())
        }
    }
}
