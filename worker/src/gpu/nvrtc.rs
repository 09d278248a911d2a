//! NVRTC, loaded by this module rather than through cudarc, and the choice of what to compile for.
//!
//! Why not cudarc's loader: with `cuda-12080` it looks for `libnvrtc.so`, `libnvrtc.so.12`,
//! `.11`, ... but never `libnvrtc.so.13`, which is all a CUDA 13 machine (or PyTorch's cu13
//! wheels) may have; it looks only on the loader path, not in the toolkit or in a Python
//! environment's `nvidia/*/lib`; and it panics when nothing is found. Here the search is
//! explicit ([`candidates`]), a miss is [`GpuError::NoNvrtc`] naming every place looked at, and
//! the NVRTC whose major version matches the driver's is preferred, so its output loads.
//!
//! Why a cubin for the device's own architecture ([`Target::Cubin`]): PTX carries an ISA
//! version that follows the NVRTC release (13.0 emits `.version 9.0`, 13.2 `.version 9.2`), and
//! a driver older than the NVRTC refuses it (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`). Machine code
//! for the device's `sm_XY` needs no JIT and loads on any driver of the same major version.
//! PTX ([`Target::Ptx`]) is the fallback for a GPU newer than the NVRTC knows; that driver is
//! then newer than the NVRTC, so it accepts the PTX.
//!
//! NVRTC finds its `libnvrtc-builtins.so.MAJOR.MINOR` by soname at compile time, which fails
//! when the library was opened by path from a directory that is not on the loader path (a
//! Python wheel). [`Nvrtc::open`] therefore opens the builtins from the same directory first;
//! the dynamic loader then finds them already loaded.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::GpuError;

/// The environment variable that names the NVRTC library to use (a path or a soname); when set,
/// nothing else is tried.
pub const NVRTC_ENV: &str = "WEIGHTSYNC_NVRTC";

/// What NVRTC is asked to produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Machine code for `sm_<arch>` (arch = 10 * major + minor).
    Cubin(u32),
    /// PTX for the virtual architecture `compute_<arch>`, JIT-compiled by the driver at load.
    Ptx(u32),
}

impl Target {
    /// The `--gpu-architecture` option.
    pub fn arch_option(self) -> String {
        match self {
            Target::Cubin(a) => format!("--gpu-architecture=sm_{a}"),
            Target::Ptx(a) => format!("--gpu-architecture=compute_{a}"),
        }
    }
}

/// Chooses what to compile for a device of compute capability `arch` (10 * major + minor) with
/// an NVRTC that supports `supported` (its `nvrtcGetSupportedArchs`): the device's own machine
/// code when NVRTC knows the arch; else PTX for the newest arch it knows below the device's.
pub fn choose_target(arch: u32, supported: &[u32]) -> Result<Target, GpuError> {
    if supported.contains(&arch) {
        return Ok(Target::Cubin(arch));
    }
    match supported.iter().copied().filter(|&a| a < arch).max() {
        Some(a) => Ok(Target::Ptx(a)),
        None => Err(GpuError::UnsupportedArch {
            arch,
            supported: supported.to_vec(),
        }),
    }
}

/// Where to look for NVRTC, in order: `WEIGHTSYNC_NVRTC` alone if set; else the sonames of
/// CUDA 13 and 12 (the driver's major version first) and the unversioned name on the loader
/// path; then the same names in `$CUDA_HOME`, `$CUDA_PATH` and `/usr/local/cuda`; then in the
/// `nvidia/*/lib` folders of the Python environments `$VIRTUAL_ENV` and `$CONDA_PREFIX`
/// (PyTorch's wheels). `env` reads an environment variable.
pub fn candidates(env: &dyn Fn(&str) -> Option<String>, driver_major: Option<u32>) -> Vec<String> {
    if let Some(explicit) = env(NVRTC_ENV).filter(|s| !s.is_empty()) {
        return vec![explicit];
    }
    let mut majors = vec![13u32, 12];
    if let Some(m) = driver_major {
        majors.retain(|&x| x != m);
        majors.insert(0, m);
    }
    let mut names: Vec<String> = majors.iter().map(|m| format!("libnvrtc.so.{m}")).collect();
    names.push("libnvrtc.so".into());
    let mut out = names.clone();
    let mut dirs: Vec<PathBuf> = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(d) = env(var).filter(|s| !s.is_empty()) {
            dirs.push(d.into());
        }
    }
    dirs.push("/usr/local/cuda".into());
    let mut lib_dirs: Vec<PathBuf> = Vec::new();
    for d in &dirs {
        lib_dirs.push(d.join("lib64"));
        lib_dirs.push(d.join("lib"));
        lib_dirs.push(d.join(format!("targets/{}-linux/lib", std::env::consts::ARCH)));
    }
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(prefix) = env(var).filter(|s| !s.is_empty()) {
            lib_dirs.extend(python_nvidia_lib_dirs(Path::new(&prefix)));
        }
    }
    for d in lib_dirs {
        for n in &names {
            let p = d.join(n).to_string_lossy().into_owned();
            if !out.contains(&p) {
                out.push(p);
            }
        }
    }
    out
}

/// `<prefix>/lib/python3.*/site-packages/nvidia/<pkg>/lib` for every such folder (the CUDA 13
/// wheels put NVRTC in `nvidia/cu13/lib`, the CUDA 12 ones in `nvidia/cuda_nvrtc/lib`).
fn python_nvidia_lib_dirs(prefix: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(pythons) = std::fs::read_dir(prefix.join("lib")) else {
        return out;
    };
    let mut pythons: Vec<PathBuf> = pythons
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("python3"))
        })
        .collect();
    pythons.sort();
    for py in pythons {
        let nvidia = py.join("site-packages/nvidia");
        let Ok(pkgs) = std::fs::read_dir(&nvidia) else {
            continue;
        };
        let mut pkgs: Vec<PathBuf> = pkgs.flatten().map(|e| e.path().join("lib")).collect();
        pkgs.sort();
        out.extend(pkgs.into_iter().filter(|p| p.is_dir()));
    }
    out
}

/// A `dlopen` handle; closed on drop.
#[derive(Debug)]
struct Library {
    handle: *mut c_void,
}

// SAFETY: a dlopen handle is a process-wide token; dlsym/dlclose may be called from any thread.
unsafe impl Send for Library {}
// SAFETY: as above; the handle is never mutated after open.
unsafe impl Sync for Library {}

impl Library {
    fn open(name: &str) -> Result<Library, String> {
        let c = CString::new(name).map_err(|_| format!("{name}: contains a NUL byte"))?;
        // SAFETY: `c` is a valid C string; dlopen has no other preconditions. Loading runs the
        // library's initialisers, which for NVRTC only set up its own state.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(format!("{name}: {}", dl_error()));
        }
        Ok(Library { handle })
    }

    /// The address of `name`, or an error naming it.
    fn symbol(&self, name: &str) -> Result<*mut c_void, String> {
        let c = CString::new(name).expect("symbol names have no NUL");
        // SAFETY: the handle is live (owned by self) and `c` is a valid C string.
        let p = unsafe { libc::dlsym(self.handle, c.as_ptr()) };
        if p.is_null() {
            Err(format!("symbol {name} missing: {}", dl_error()))
        } else {
            Ok(p)
        }
    }
}

impl Drop for Library {
    fn drop(&mut self) {
        // SAFETY: the handle came from a successful dlopen and is closed once, here; nothing
        // obtained from it (function pointers in `Fns`) outlives the owning `Nvrtc`.
        unsafe { libc::dlclose(self.handle) };
    }
}

fn dl_error() -> String {
    // SAFETY: dlerror returns a thread-local string or NULL.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-NULL dlerror results are NUL-terminated strings.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

type Prog = *mut c_void;
type Status = c_int;

type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status;
type ErrorStringFn = unsafe extern "C" fn(Status) -> *const c_char;
type ArchsFn = unsafe extern "C" fn(*mut c_int) -> Status;
type CreateFn = unsafe extern "C" fn(
    *mut Prog,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> Status;
type DestroyFn = unsafe extern "C" fn(*mut Prog) -> Status;
type CompileFn = unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> Status;
type SizeFn = unsafe extern "C" fn(Prog, *mut usize) -> Status;
type CopyFn = unsafe extern "C" fn(Prog, *mut c_char) -> Status;

/// The NVRTC entry points used here (their C signatures, CUDA 11.2 and later).
#[derive(Debug, Clone, Copy)]
struct Fns {
    version: VersionFn,
    error_string: ErrorStringFn,
    num_supported_archs: ArchsFn,
    supported_archs: ArchsFn,
    create_program: CreateFn,
    destroy_program: DestroyFn,
    compile_program: CompileFn,
    log_size: SizeFn,
    log: CopyFn,
    cubin_size: SizeFn,
    cubin: CopyFn,
    ptx_size: SizeFn,
    ptx: CopyFn,
}

impl Fns {
    fn load(lib: &Library) -> Result<Fns, String> {
        macro_rules! sym {
            ($name:literal, $ty:ty) => {{
                let p = lib.symbol($name)?;
                // SAFETY: `p` is the address of the NVRTC function `$name`, whose C signature
                // is `$ty` (NVRTC's public header); it stays valid while `lib` is loaded, and
                // `Fns` is only ever stored beside the `Library` it came from.
                unsafe { std::mem::transmute::<*mut c_void, $ty>(p) }
            }};
        }
        Ok(Fns {
            version: sym!("nvrtcVersion", VersionFn),
            error_string: sym!("nvrtcGetErrorString", ErrorStringFn),
            num_supported_archs: sym!("nvrtcGetNumSupportedArchs", ArchsFn),
            supported_archs: sym!("nvrtcGetSupportedArchs", ArchsFn),
            create_program: sym!("nvrtcCreateProgram", CreateFn),
            destroy_program: sym!("nvrtcDestroyProgram", DestroyFn),
            compile_program: sym!("nvrtcCompileProgram", CompileFn),
            log_size: sym!("nvrtcGetProgramLogSize", SizeFn),
            log: sym!("nvrtcGetProgramLog", CopyFn),
            cubin_size: sym!("nvrtcGetCUBINSize", SizeFn),
            cubin: sym!("nvrtcGetCUBIN", CopyFn),
            ptx_size: sym!("nvrtcGetPTXSize", SizeFn),
            ptx: sym!("nvrtcGetPTX", CopyFn),
        })
    }
}

/// A loaded NVRTC library.
#[derive(Debug)]
pub struct Nvrtc {
    fns: Fns,
    path: String,
    version: (u32, u32),
    archs: Vec<u32>,
    // The libraries stay open as long as `fns` (pointers into `_lib`) can be called.
    _builtins: Option<Library>,
    _lib: Library,
}

/// What NVRTC produced.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// A cubin, or PTX text with its terminating NUL (what `cuModuleLoadData` takes).
    pub image: Vec<u8>,
    /// What it was compiled for.
    pub target: Target,
    /// NVRTC's log (warnings; `--ptxas-options=-v` output).
    pub log: String,
}

impl Nvrtc {
    /// Opens the NVRTC library `name` (a path or a soname).
    pub fn open(name: &str) -> Result<Nvrtc, String> {
        let lib = Library::open(name)?;
        let fns = Fns::load(&lib)?;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: valid out-pointers; nvrtcVersion has no other preconditions.
        let s = unsafe { (fns.version)(&mut major, &mut minor) };
        if s != 0 {
            return Err(format!("{name}: nvrtcVersion failed ({s})"));
        }
        let mut n: c_int = 0;
        // SAFETY: valid out-pointer.
        let s = unsafe { (fns.num_supported_archs)(&mut n) };
        if s != 0 || n < 0 {
            return Err(format!("{name}: nvrtcGetNumSupportedArchs failed ({s})"));
        }
        let mut archs = vec![0 as c_int; n as usize];
        // SAFETY: `archs` holds exactly the `n` entries NVRTC said it will write.
        let s = unsafe { (fns.supported_archs)(archs.as_mut_ptr()) };
        if s != 0 {
            return Err(format!("{name}: nvrtcGetSupportedArchs failed ({s})"));
        }
        let path = loaded_path(fns.version as *const c_void).unwrap_or_else(|| name.into());
        let version = (major as u32, minor as u32);
        let builtins = Path::new(&path)
            .parent()
            .map(|d| d.join(format!("libnvrtc-builtins.so.{major}.{minor}")))
            .filter(|p| p.exists())
            .and_then(|p| Library::open(&p.to_string_lossy()).ok());
        Ok(Nvrtc {
            fns,
            path,
            version,
            archs: archs.into_iter().map(|a| a as u32).collect(),
            _builtins: builtins,
            _lib: lib,
        })
    }

    /// The first loadable NVRTC of [`candidates`] (from the process environment) whose major
    /// version is at most the driver's, else the first loadable one; or [`GpuError::NoNvrtc`].
    pub fn find(driver_major: Option<u32>) -> Result<Nvrtc, GpuError> {
        let list = candidates(&|k| std::env::var(k).ok(), driver_major);
        Self::find_in(&list, driver_major)
    }

    /// As [`Nvrtc::find`], over an explicit list of names.
    pub fn find_in(list: &[String], driver_major: Option<u32>) -> Result<Nvrtc, GpuError> {
        let mut fallback = None;
        let mut errors = Vec::new();
        for name in list {
            if name.contains('/') && !Path::new(name).exists() {
                continue;
            }
            match Nvrtc::open(name) {
                Ok(n) if driver_major.is_none_or(|m| n.version.0 <= m) => return Ok(n),
                Ok(n) => {
                    errors.push(format!(
                        "{}: NVRTC {}.{} is newer than the driver's CUDA {}",
                        n.path,
                        n.version.0,
                        n.version.1,
                        driver_major.unwrap_or(0)
                    ));
                    fallback.get_or_insert(n);
                }
                Err(e) => errors.push(e),
            }
        }
        fallback.ok_or_else(|| GpuError::NoNvrtc {
            searched: list.join(", "),
            errors: errors.join("; "),
        })
    }

    /// The process-wide NVRTC, found on first use (see [`Nvrtc::find`]) and kept loaded.
    pub fn global(driver_major: Option<u32>) -> Result<&'static Nvrtc, GpuError> {
        static GLOBAL: OnceLock<Nvrtc> = OnceLock::new();
        if let Some(n) = GLOBAL.get() {
            return Ok(n);
        }
        let n = Nvrtc::find(driver_major)?;
        Ok(GLOBAL.get_or_init(|| n))
    }

    /// Where the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// (major, minor).
    pub fn version(&self) -> (u32, u32) {
        self.version
    }

    /// The real architectures it can emit machine code for (10 * major + minor).
    pub fn supported_archs(&self) -> &[u32] {
        &self.archs
    }

    /// Compiles `source` for `target` with `options` (besides the architecture).
    pub fn compile(
        &self,
        source: &str,
        name: &str,
        target: Target,
        options: &[String],
    ) -> Result<Compiled, GpuError> {
        let src = CString::new(source).map_err(|_| self.err(name, "source has a NUL byte"))?;
        let cname = CString::new(name).map_err(|_| self.err(name, "name has a NUL byte"))?;
        let mut opts: Vec<CString> = Vec::with_capacity(options.len() + 1);
        for o in std::iter::once(&target.arch_option()).chain(options) {
            opts.push(CString::new(o.as_str()).map_err(|_| self.err(name, "option has NUL"))?);
        }
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog = Program {
            fns: &self.fns,
            prog: std::ptr::null_mut(),
        };
        // SAFETY: valid out-pointer and C strings; no headers (count 0, null arrays).
        let s = unsafe {
            (self.fns.create_program)(
                &mut prog.prog,
                src.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        self.check(s, name, "nvrtcCreateProgram")?;
        // SAFETY: `prog` is a live program; `opt_ptrs` holds `len` valid C strings that outlive
        // the call.
        let s = unsafe {
            (self.fns.compile_program)(prog.prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr())
        };
        let log = prog.read(self.fns.log_size, self.fns.log);
        let log = String::from_utf8_lossy(&log)
            .trim_end_matches('\0')
            .trim()
            .to_string();
        if s != 0 {
            return Err(GpuError::Compile {
                name: name.into(),
                nvrtc: self.describe(),
                log: format!("{} ({s}): {log}", self.status(s)),
            });
        }
        let image = match target {
            Target::Cubin(_) => prog.read(self.fns.cubin_size, self.fns.cubin),
            Target::Ptx(_) => prog.read(self.fns.ptx_size, self.fns.ptx),
        };
        if image.is_empty() {
            return Err(self.err(name, "NVRTC returned an empty image"));
        }
        Ok(Compiled { image, target, log })
    }

    fn describe(&self) -> String {
        format!(
            "NVRTC {}.{} at {}",
            self.version.0, self.version.1, self.path
        )
    }

    fn status(&self, s: Status) -> String {
        // SAFETY: nvrtcGetErrorString accepts any status and returns a static C string.
        let p = unsafe { (self.fns.error_string)(s) };
        if p.is_null() {
            format!("status {s}")
        } else {
            // SAFETY: non-NULL results are static NUL-terminated strings.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    }

    fn check(&self, s: Status, name: &str, what: &str) -> Result<(), GpuError> {
        if s == 0 {
            Ok(())
        } else {
            Err(self.err(name, &format!("{what}: {}", self.status(s))))
        }
    }

    fn err(&self, name: &str, msg: &str) -> GpuError {
        GpuError::Compile {
            name: name.into(),
            nvrtc: self.describe(),
            log: msg.into(),
        }
    }
}

/// An NVRTC program; destroyed on drop.
struct Program<'a> {
    fns: &'a Fns,
    prog: Prog,
}

impl Program<'_> {
    /// Reads one of the program's outputs through its size/copy pair (empty on failure).
    fn read(&self, size: SizeFn, copy: CopyFn) -> Vec<u8> {
        let mut n = 0usize;
        // SAFETY: `prog` is live; valid out-pointer.
        if unsafe { size(self.prog, &mut n) } != 0 || n == 0 {
            return Vec::new();
        }
        let mut buf = vec![0u8; n];
        // SAFETY: `buf` holds the `n` bytes NVRTC said it will write.
        if unsafe { copy(self.prog, buf.as_mut_ptr().cast()) } != 0 {
            return Vec::new();
        }
        buf
    }
}

impl Drop for Program<'_> {
    fn drop(&mut self) {
        if !self.prog.is_null() {
            // SAFETY: `prog` came from a successful nvrtcCreateProgram and is destroyed once.
            unsafe { (self.fns.destroy_program)(&mut self.prog) };
        }
    }
}

/// The file a loaded symbol lives in.
fn loaded_path(addr: *const c_void) -> Option<String> {
    // SAFETY: Dl_info is plain data; zeroed is a valid initial value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `addr` is a symbol address inside a loaded library; `info` is a valid out-pointer.
    if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr filled `dli_fname` with a NUL-terminated path owned by the loader.
    Some(
        unsafe { CStr::from_ptr(info.dli_fname) }
            .to_string_lossy()
            .into_owned(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn an_explicit_nvrtc_is_the_only_candidate() {
        let e = env(&[(NVRTC_ENV, "/opt/x/libnvrtc.so.13"), ("CUDA_HOME", "/c")]);
        assert_eq!(candidates(&e, Some(12)), vec!["/opt/x/libnvrtc.so.13"]);
    }

    #[test]
    fn cuda_13_is_searched_and_the_drivers_major_comes_first() {
        let none = env(&[]);
        let c = candidates(&none, None);
        assert_eq!(&c[..3], ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]);
        assert!(c.contains(&"/usr/local/cuda/lib64/libnvrtc.so.13".to_string()));
        let c12 = candidates(&none, Some(12));
        assert_eq!(
            &c12[..3],
            ["libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so"]
        );
        let with_home = candidates(&env(&[("CUDA_HOME", "/opt/cuda-13.0")]), Some(13));
        let home = with_home
            .iter()
            .position(|p| p == "/opt/cuda-13.0/lib64/libnvrtc.so.13")
            .expect("CUDA_HOME searched");
        let usr = with_home
            .iter()
            .position(|p| p == "/usr/local/cuda/lib64/libnvrtc.so.13")
            .unwrap();
        assert!(home < usr, "CUDA_HOME before /usr/local/cuda");
    }

    #[test]
    fn a_python_environments_nvidia_wheels_are_searched() {
        let venv = tempfile::tempdir().unwrap();
        for pkg in ["cu13", "cuda_nvrtc", "cudnn"] {
            std::fs::create_dir_all(
                venv.path()
                    .join(format!("lib/python3.12/site-packages/nvidia/{pkg}/lib")),
            )
            .unwrap();
        }
        let prefix = venv.path().to_string_lossy().into_owned();
        let c = candidates(&env(&[("VIRTUAL_ENV", &prefix)]), None);
        let want = format!("{prefix}/lib/python3.12/site-packages/nvidia/cu13/lib/libnvrtc.so.13");
        assert!(c.contains(&want), "{want} not in {c:?}");
        let want12 =
            format!("{prefix}/lib/python3.12/site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.12");
        assert!(c.contains(&want12));
    }

    #[test]
    fn a_missing_nvrtc_is_a_clean_error_that_names_where_it_looked() {
        let list = vec![
            "/nonexistent/libnvrtc.so.13".to_string(),
            "libnvrtc-does-not-exist.so.99".to_string(),
        ];
        match Nvrtc::find_in(&list, Some(13)) {
            Err(GpuError::NoNvrtc { searched, errors }) => {
                assert!(searched.contains("/nonexistent/libnvrtc.so.13"));
                assert!(errors.contains("libnvrtc-does-not-exist.so.99"), "{errors}");
                let msg = GpuError::NoNvrtc { searched, errors }.to_string();
                assert!(msg.contains(NVRTC_ENV), "{msg}");
            }
            other => panic!("expected NoNvrtc, got {other:?}"),
        }
    }

    #[test]
    fn the_target_is_the_devices_own_cubin_else_older_ptx() {
        let cuda13 = [75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121];
        assert_eq!(choose_target(90, &cuda13).unwrap(), Target::Cubin(90));
        assert_eq!(choose_target(80, &cuda13).unwrap(), Target::Cubin(80));
        // A GPU newer than this NVRTC: PTX for the newest arch it knows, JIT-compiled by the
        // (newer) driver.
        assert_eq!(choose_target(130, &cuda13).unwrap(), Target::Ptx(121));
        // Volta was dropped in CUDA 13: nothing to compile for.
        match choose_target(70, &cuda13) {
            Err(GpuError::UnsupportedArch { arch: 70, .. }) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(Target::Cubin(90).arch_option(), "--gpu-architecture=sm_90");
        assert_eq!(
            Target::Ptx(90).arch_option(),
            "--gpu-architecture=compute_90"
        );
    }
}
