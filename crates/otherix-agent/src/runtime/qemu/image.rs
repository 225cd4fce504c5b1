//! The QEMU runtime's guest image: a Debian cloud kernel and a busybox
//! initramfs, built from Debian packages on the machine (`apt-get download`,
//! unpacked, never installed), nothing fetched from anywhere else.
//!
//! An image is a directory `{cache}/{name}` holding `vmlinuz`, `initrd.cpio`
//! and `image.json`. [`ensure`] returns it, building it first under a lock
//! when it is missing (so `otherix image build` is optional: the agent builds
//! the image on first use, and agents sharing a host build it once). The
//! build is written beside the image and renamed into place, so a crash
//! midway leaves no half image.
//!
//! The initramfs holds busybox (`busybox-static`), dropbear (`dropbear-bin`
//! and the libraries it needs, from its packages' dependencies), the virtio
//! network and `qemu_fw_cfg` modules with their dependencies (read from each
//! module's `depends=`), and `init.sh` as `/init`: see there for what a guest
//! serves and how it learns its address and keys.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::json;

/// The image a VM gets when it names none.
pub const DEFAULT_IMAGE: &str = "default";
/// The kernel package the standard image is built from (a metapackage: its
/// dependency names the versioned kernel).
pub const KERNEL_PACKAGE: &str = "linux-image-cloud-amd64";
/// Userland packages; their libraries come with their dependencies.
const USER_PACKAGES: &[&str] = &["busybox-static", "dropbear-bin"];
/// Modules the guest loads (with what they depend on): the NIC and fw_cfg.
const MODULES: &[&str] = &["virtio_net", "virtio_pci", "qemu_fw_cfg"];
/// The guest's `/init`.
const INIT: &str = include_str!("init.sh");
/// Environment variable naming the image cache directory.
pub const CACHE_ENV: &str = "OTHERIX_IMAGE_CACHE";

/// A built guest image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Image {
    pub name: String,
    pub dir: PathBuf,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    /// The kernel's release (`6.1.0-57-cloud-amd64`).
    pub kernel_release: String,
}

/// Why an image could not be found or built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImageError {
    /// Caller error: no such image name is possible.
    #[error("image name {0:?} is invalid: 1 to 64 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit")]
    InvalidName(String),
    /// A tool the build needs failed or is missing (apt, dpkg-deb).
    #[error("{tool}: {detail}")]
    Tool { tool: String, detail: String },
    /// What a package should hold is not there.
    #[error("{0}")]
    Missing(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ImageError {
    let what = what.into();
    move |source| ImageError::Io { what, source }
}

/// Where images are kept: `$OTHERIX_IMAGE_CACHE`, else `/var/cache/otherix/images`
/// for root (agents) and `$XDG_CACHE_HOME/otherix/images` for others.
pub fn default_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(CACHE_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    if nix::unistd::geteuid().is_root() {
        return PathBuf::from("/var/cache/otherix/images");
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    base.join("otherix/images")
}

/// Checks an image name (it becomes a directory name).
pub fn validate_name(name: &str) -> Result<(), ImageError> {
    let ok = (1..=64).contains(&name.len())
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ImageError::InvalidName(name.to_owned()))
    }
}

impl Image {
    /// The image `name` in `cache`, if it is built.
    pub fn open(cache: &Path, name: &str) -> Result<Option<Image>, ImageError> {
        validate_name(name)?;
        let dir = cache.join(name);
        let meta = match fs::read(dir.join("image.json")) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(format!("read {}", dir.join("image.json").display()))(e)),
        };
        let meta: serde_json::Value = serde_json::from_slice(&meta)
            .map_err(|e| ImageError::Missing(format!("{}: image.json is not JSON: {e}", dir.display())))?;
        let image = Image {
            name: name.to_owned(),
            kernel: dir.join("vmlinuz"),
            initrd: dir.join("initrd.cpio"),
            kernel_release: meta["kernel_release"].as_str().unwrap_or("unknown").to_owned(),
            dir,
        };
        for f in [&image.kernel, &image.initrd] {
            if !f.is_file() {
                return Err(ImageError::Missing(format!(
                    "image {name}: {} is missing",
                    f.display()
                )));
            }
        }
        Ok(Some(image))
    }
}

/// The image `name`, built first if it is not there yet. Only the standard
/// recipe is built; another name must be built with it too (`otherix image
/// build NAME`) or put in place by hand (a directory with `vmlinuz`,
/// `initrd.cpio` and `image.json`).
pub fn ensure(cache: &Path, name: &str, progress: &mut dyn FnMut(&str)) -> Result<Image, ImageError> {
    if let Some(image) = Image::open(cache, name)? {
        return Ok(image);
    }
    build(cache, name, false, progress)
}

/// Builds the image `name` with the standard recipe, under the cache's lock;
/// one already there is kept unless `rebuild`.
pub fn build(
    cache: &Path,
    name: &str,
    rebuild: bool,
    progress: &mut dyn FnMut(&str),
) -> Result<Image, ImageError> {
    validate_name(name)?;
    fs::create_dir_all(cache).map_err(io(format!("create {}", cache.display())))?;
    let lock = File::create(cache.join(".lock")).map_err(io("open the image cache's lock"))?;
    let _lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| io("lock the image cache")(e.into()))?;
    if !rebuild {
        // Another process may have built it while we waited for the lock.
        if let Some(image) = Image::open(cache, name)? {
            return Ok(image);
        }
    }
    let work = cache.join(format!(".{name}.build-{}", std::process::id()));
    let _ = fs::remove_dir_all(&work);
    let result = build_in(&work, progress);
    let _release = match result {
        Ok(b) => b,
        Err(e) => {
            let _ = fs::remove_dir_all(&work);
            return Err(e);
        }
    };
    let out = work.join("out");
    let dir = cache.join(name);
    let old = cache.join(format!(".{name}.old-{}", std::process::id()));
    if dir.exists() {
        fs::rename(&dir, &old).map_err(io(format!("move the old {} aside", dir.display())))?;
    }
    fs::rename(&out, &dir).map_err(io(format!("put {} in place", dir.display())))?;
    let _ = fs::remove_dir_all(&old);
    let _ = fs::remove_dir_all(&work);
    Image::open(cache, name)?
        .ok_or_else(|| ImageError::Missing(format!("image {name} vanished after its build")))
}

/// Builds into `work/out`; returns the kernel release.
fn build_in(work: &Path, progress: &mut dyn FnMut(&str)) -> Result<String, ImageError> {
    let debs = work.join("debs");
    let stage = work.join("stage");
    let kroot = work.join("kernel");
    let out = work.join("out");
    for d in [&debs, &stage, &kroot, &out] {
        fs::create_dir_all(d).map_err(io(format!("create {}", d.display())))?;
    }

    progress(&format!(
        "resolving {KERNEL_PACKAGE} and {}",
        USER_PACKAGES.join(", ")
    ));
    let kernel_pkg = kernel_package()?;
    let mut packages = vec![kernel_pkg.clone()];
    packages.extend(user_packages()?);
    progress(&format!("downloading {} packages with apt-get", packages.len()));
    let download = || {
        let mut apt = Command::new("apt-get");
        apt.args(["-q", "-o", "APT::Sandbox::User=root", "download"])
            .args(&packages)
            .current_dir(&debs);
        run("apt-get download", &mut apt)
    };
    if let Err(first) = download() {
        // Package lists older than the archive name versions it no longer has.
        progress(&format!("{first}; updating apt's package lists and trying again"));
        run("apt-get update", Command::new("apt-get").args(["-q", "update"]))?;
        download()?;
    }

    let mut files: Vec<PathBuf> = fs::read_dir(&debs)
        .map_err(io("list the downloaded packages"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "deb"))
        .collect();
    files.sort();
    progress(&format!("unpacking {} packages", files.len()));
    for deb in &files {
        let is_kernel = deb
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(&format!("{kernel_pkg}_")));
        let into = if is_kernel { &kroot } else { &stage };
        run(
            "dpkg-deb -x",
            Command::new("dpkg-deb").arg("-x").arg(deb).arg(into),
        )?;
    }

    // The kernel and its modules.
    let (vmlinuz, release) = find_kernel(&kroot)?;
    fs::copy(&vmlinuz, out.join("vmlinuz")).map_err(io("copy the kernel"))?;
    let modules = module_closure(&kroot.join("lib/modules").join(&release))?;

    progress("assembling the initramfs");
    let mut archive = Archive::default();
    for d in [
        "bin",
        "sbin",
        "etc",
        "etc/dropbear",
        "proc",
        "sys",
        "dev",
        "root",
        "tmp",
        "run",
        "var",
        "var/run",
        "www",
        "www/cgi-bin",
        "lib",
        "lib/modules",
        "lib64",
        "usr",
        "usr/lib",
    ] {
        archive.dir(d);
    }
    archive.file("init", 0o755, INIT.as_bytes().to_vec());
    archive.file(
        "bin/busybox",
        0o755,
        read(&first_existing(&stage, &["bin/busybox", "usr/bin/busybox"])?)?,
    );
    archive.symlink("bin/sh", "busybox");
    archive.file(
        "sbin/dropbear",
        0o755,
        read(&first_existing(&stage, &["usr/sbin/dropbear", "sbin/dropbear"])?)?,
    );
    // Every shared library the userland packages brought (top level only).
    for libdir in ["lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu"] {
        archive.dir(libdir);
        let Ok(entries) = fs::read_dir(stage.join(libdir)) else {
            continue;
        };
        let mut entries: Vec<_> = entries.filter_map(Result::ok).collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let path = e.path();
            let name = format!("{libdir}/{}", e.file_name().to_string_lossy());
            let meta = fs::symlink_metadata(&path).map_err(io(format!("stat {}", path.display())))?;
            if meta.file_type().is_symlink() {
                let target = fs::read_link(&path).map_err(io(format!("read link {}", path.display())))?;
                archive.symlink(&name, &target.to_string_lossy());
            } else if meta.is_file() {
                archive.file(&name, meta.mode() & 0o777, read(&path)?);
            }
        }
    }
    archive.symlink(
        "lib64/ld-linux-x86-64.so.2",
        "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
    );
    let mut order = Vec::new();
    for (name, path) in &modules {
        archive.file(&format!("lib/modules/{name}.ko"), 0o644, read(path)?);
        order.push(name.as_str());
    }
    archive.file(
        "etc/modules",
        0o644,
        format!("{}\n", order.join("\n")).into_bytes(),
    );
    archive.file("etc/passwd", 0o644, b"root:*:0:0:root:/root:/bin/sh\n".to_vec());
    archive.file("etc/group", 0o644, b"root:x:0:\n".to_vec());
    archive.file("etc/shells", 0o644, b"/bin/sh\n".to_vec());
    archive.file(
        "www/cgi-bin/uptime",
        0o755,
        b"#!/bin/sh\necho 'Content-Type: text/plain'\necho\ncat /proc/uptime\n".to_vec(),
    );
    let mut f = File::create(out.join("initrd.cpio")).map_err(io("create initrd.cpio"))?;
    archive.write_to(&mut f).map_err(io("write initrd.cpio"))?;
    f.sync_all().map_err(io("sync initrd.cpio"))?;

    let meta = json!({
        "kernel_release": release,
        "packages": packages,
        "modules": order,
        "built_at": time::OffsetDateTime::now_utc().unix_timestamp(),
    });
    fs::write(
        out.join("image.json"),
        serde_json::to_vec_pretty(&meta).unwrap_or_default(),
    )
    .map_err(io("write image.json"))?;
    Ok(release)
}

fn read(path: &Path) -> Result<Vec<u8>, ImageError> {
    fs::read(path).map_err(io(format!("read {}", path.display())))
}

fn first_existing(root: &Path, candidates: &[&str]) -> Result<PathBuf, ImageError> {
    candidates
        .iter()
        .map(|c| root.join(c))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            ImageError::Missing(format!(
                "none of {} in the unpacked packages",
                candidates.join(", ")
            ))
        })
}

/// Runs a command; its stderr's last line is the error.
fn run(tool: &str, cmd: &mut Command) -> Result<String, ImageError> {
    let out = cmd.output().map_err(|e| ImageError::Tool {
        tool: tool.to_owned(),
        detail: if e.kind() == std::io::ErrorKind::NotFound {
            "not found: the image is built with Debian's apt and dpkg".into()
        } else {
            e.to_string()
        },
    })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let line = err
            .lines()
            .rev()
            .find(|l| l.starts_with("E:") || !l.trim().is_empty())
            .unwrap_or("failed")
            .trim()
            .to_owned();
        return Err(ImageError::Tool {
            tool: tool.to_owned(),
            detail: format!("{line} ({})", out.status),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The versioned kernel package [`KERNEL_PACKAGE`] depends on.
fn kernel_package() -> Result<String, ImageError> {
    let out = run(
        "apt-cache depends",
        Command::new("apt-cache").args(["depends", KERNEL_PACKAGE]),
    )?;
    out.lines()
        .filter_map(|l| l.trim().strip_prefix("Depends:"))
        .map(str::trim)
        .find(|p| p.starts_with("linux-image-"))
        .map(str::to_owned)
        .ok_or_else(|| {
            ImageError::Missing(format!(
                "{KERNEL_PACKAGE} names no kernel package (is apt's package list up to date?)"
            ))
        })
}

/// [`USER_PACKAGES`] and everything they depend on (not recommends).
fn user_packages() -> Result<Vec<String>, ImageError> {
    let out = run(
        "apt-cache depends",
        Command::new("apt-cache")
            .args([
                "depends",
                "--recurse",
                "--no-recommends",
                "--no-suggests",
                "--no-conflicts",
                "--no-breaks",
                "--no-replaces",
                "--no-enhances",
                "--no-pre-depends",
            ])
            .args(USER_PACKAGES),
    )?;
    let found: BTreeSet<String> = out
        .lines()
        .filter(|l| !l.starts_with(' ') && !l.starts_with('<') && !l.trim().is_empty())
        .map(|l| l.trim().to_owned())
        .collect();
    for p in USER_PACKAGES {
        if !found.contains(*p) {
            return Err(ImageError::Missing(format!("package {p} is unknown to apt")));
        }
    }
    Ok(found.into_iter().collect())
}

/// `boot/vmlinuz-RELEASE` in the unpacked kernel package.
fn find_kernel(root: &Path) -> Result<(PathBuf, String), ImageError> {
    let boot = root.join("boot");
    let entries = fs::read_dir(&boot).map_err(io(format!("list {}", boot.display())))?;
    for e in entries.filter_map(Result::ok) {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(release) = name.strip_prefix("vmlinuz-") {
            return Ok((e.path(), release.to_owned()));
        }
    }
    Err(ImageError::Missing(format!("no vmlinuz in {}", boot.display())))
}

/// [`MODULES`] and their dependencies, in an order `insmod` can load them
/// (dependencies first), by name with their file.
fn module_closure(dir: &Path) -> Result<Vec<(String, PathBuf)>, ImageError> {
    let mut all = BTreeMap::new();
    index_modules(dir, &mut all)?;
    let mut order = Vec::new();
    let mut seen = BTreeSet::new();
    for m in MODULES {
        visit_module(m, &all, &mut seen, &mut order, 0)?;
    }
    Ok(order)
}

fn index_modules(dir: &Path, into: &mut BTreeMap<String, PathBuf>) -> Result<(), ImageError> {
    for e in fs::read_dir(dir)
        .map_err(io(format!("list {}", dir.display())))?
        .filter_map(Result::ok)
    {
        let path = e.path();
        if path.is_dir() {
            index_modules(&path, into)?;
        } else if let Some(stem) = e.file_name().to_string_lossy().strip_suffix(".ko") {
            into.insert(stem.replace('-', "_"), path);
        }
    }
    Ok(())
}

fn visit_module(
    name: &str,
    all: &BTreeMap<String, PathBuf>,
    seen: &mut BTreeSet<String>,
    order: &mut Vec<(String, PathBuf)>,
    depth: usize,
) -> Result<(), ImageError> {
    if seen.contains(name) {
        return Ok(());
    }
    if depth > 32 {
        return Err(ImageError::Missing(format!(
            "module dependencies too deep at {name}"
        )));
    }
    let Some(path) = all.get(name) else {
        return Err(ImageError::Missing(format!(
            "kernel module {name} is not in the kernel package (built in?)"
        )));
    };
    for dep in module_depends(&read(path)?) {
        visit_module(&dep, all, seen, order, depth + 1)?;
    }
    seen.insert(name.to_owned());
    order.push((name.to_owned(), path.clone()));
    Ok(())
}

/// The `depends=` of a module's `.modinfo` strings.
fn module_depends(ko: &[u8]) -> Vec<String> {
    const KEY: &[u8] = b"\0depends=";
    let Some(at) = ko.windows(KEY.len()).position(|w| w == KEY) else {
        return Vec::new();
    };
    let rest = &ko[at + KEY.len()..];
    let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
    String::from_utf8_lossy(&rest[..end])
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.replace('-', "_"))
        .collect()
}

/// An initramfs in the `newc` cpio format, built in memory, written with
/// fixed owners and times so the same packages make the same bytes.
#[derive(Default)]
struct Archive {
    entries: BTreeMap<String, (u32, Vec<u8>)>,
}

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;

impl Archive {
    fn dir(&mut self, path: &str) {
        self.entries
            .insert(path.to_owned(), (S_IFDIR | 0o755, Vec::new()));
    }
    fn file(&mut self, path: &str, perm: u32, data: Vec<u8>) {
        self.entries
            .insert(path.to_owned(), (S_IFREG | (perm & 0o7777), data));
    }
    fn symlink(&mut self, path: &str, target: &str) {
        self.entries
            .insert(path.to_owned(), (S_IFLNK | 0o777, target.as_bytes().to_vec()));
    }

    fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        let mut w = std::io::BufWriter::new(w);
        let mut offset = 0usize;
        // Parents sort before their children (a path's prefix sorts first).
        for (ino, (path, (mode, data))) in self.entries.iter().enumerate() {
            offset += write_entry(&mut w, ino as u32 + 1, path, *mode, data, offset)?;
        }
        write_entry(&mut w, 0, "TRAILER!!!", 0, &[], offset)?;
        w.flush()
    }
}

fn write_entry(
    w: &mut impl Write,
    ino: u32,
    name: &str,
    mode: u32,
    data: &[u8],
    offset: usize,
) -> std::io::Result<usize> {
    let nlink = if mode & 0o170000 == S_IFDIR { 2 } else { 1 };
    let header = format!(
        "070701{ino:08x}{mode:08x}{:08x}{:08x}{nlink:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
        0,
        0,
        0,
        data.len(),
        0,
        0,
        0,
        0,
        name.len() + 1,
        0
    );
    let mut n = 0;
    w.write_all(header.as_bytes())?;
    w.write_all(name.as_bytes())?;
    w.write_all(&[0])?;
    n += header.len() + name.len() + 1;
    let pad = (4 - (offset + n) % 4) % 4;
    w.write_all(&[0; 3][..pad])?;
    n += pad;
    w.write_all(data)?;
    n += data.len();
    let pad = (4 - (offset + n) % 4) % 4;
    w.write_all(&[0; 3][..pad])?;
    n += pad;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn module_depends_are_read_from_modinfo() {
        let ko = b"\x7fELF...\0license=GPL\0depends=virtio_ring,virtio,net_failover\0retpoline=Y\0";
        assert_eq!(module_depends(ko), ["virtio_ring", "virtio", "net_failover"]);
        assert!(module_depends(b"\0depends=\0").is_empty());
        assert!(module_depends(b"nothing").is_empty());
    }

    #[test]
    fn image_names_are_directory_safe() {
        for ok in ["default", "web-1", "a.b_c"] {
            assert!(validate_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "../x", "Default", "-x", ".hidden", "a/b", &"x".repeat(65)] {
            assert!(validate_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_archive_is_newc_that_cpio_reads() {
        let mut a = Archive::default();
        a.dir("bin");
        a.file("bin/hello", 0o755, b"hi\n".to_vec());
        a.symlink("bin/sh", "hello");
        a.file("init", 0o755, b"#!/bin/sh\n".to_vec());
        let mut bytes = Vec::new();
        a.write_to(&mut bytes).unwrap();
        assert_eq!(bytes.len() % 4, 0);
        let dir = std::env::temp_dir().join(format!("otherix-cpio-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let mut child = Command::new("cpio")
            .args(["-idm", "--quiet"])
            .current_dir(&dir)
            .stdin(std::process::Stdio::piped())
            .spawn();
        let Ok(child) = child.as_mut() else {
            eprintln!("skipped: cpio is not installed");
            return;
        };
        child.stdin.take().unwrap().write_all(&bytes).unwrap();
        assert!(child.wait().unwrap().success());
        assert_eq!(fs::read(dir.join("bin/hello")).unwrap(), b"hi\n");
        assert_eq!(fs::read_link(dir.join("bin/sh")).unwrap(), Path::new("hello"));
        assert_eq!(
            fs::metadata(dir.join("init")).unwrap().permissions().mode() & 0o777,
            0o755
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
