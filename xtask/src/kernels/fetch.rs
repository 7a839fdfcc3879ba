//! Each kernel's image package from the machine's Debian mirror, with a private apt state per
//! kernel (the machine's own apt state is never touched), unpacked with `dpkg-deb -x` (no
//! maintainer scripts) into `target/kernels/NAME/root` once: `stamp` there names the package,
//! and while it is there nothing is downloaded again (remove the directory to refresh).

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{ensure, Context, Result};

use super::{show, Kernel, FLAVOUR};
use crate::cpython::{
    apt::{apt_tool, update},
    quiet,
};

/// Where `kernel`'s files live.
pub(super) fn dir(kernel: &Kernel) -> PathBuf {
    crate::root().join("target/kernels").join(kernel.name)
}

/// `kernel`'s image (`…/root/boot/vmlinuz-RELEASE`, its modules beside it under
/// `…/root/[usr/]lib/modules/RELEASE`, where virtme-ng looks), downloaded and unpacked if not yet.
pub(super) fn image(kernel: &Kernel) -> Result<PathBuf> {
    let dir = dir(kernel);
    let root = dir.join("root");
    let stamp = dir.join("stamp");
    if stamp.exists() {
        if let Some(image) = find_image(&root)? {
            return Ok(image);
        }
    }
    let apt = dir.join("apt");
    let packages = resolve(kernel, &apt)?;
    eprintln!(
        "xtask: downloading {} ({})",
        packages.join(" "),
        kernel.suite
    );
    let debs = apt.join("debs");
    if debs.exists() {
        fs::remove_dir_all(&debs)?;
    }
    fs::create_dir_all(&debs)?;
    quiet(
        apt_tool("apt-get", &apt)
            .arg("download")
            .args(&packages)
            .current_dir(&debs),
        "apt-get download",
    )?;
    let mut files: Vec<PathBuf> = fs::read_dir(&debs)?
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "deb"))
        .collect();
    files.sort();
    ensure!(
        files.len() == packages.len(),
        "apt-get download left {} .deb files in {} for {} packages",
        files.len(),
        show(&debs),
        packages.len()
    );
    // A stamp without a whole root must not survive a failed unpack.
    let _ = fs::remove_file(&stamp);
    if root.exists() {
        fs::remove_dir_all(&root)?;
    }
    for deb in &files {
        quiet(
            Command::new("dpkg-deb").arg("-x").arg(deb).arg(&root),
            "dpkg-deb -x",
        )?;
    }
    let image = find_image(&root)?
        .with_context(|| format!("no boot/vmlinuz-* in {}", packages.join(" ")))?;
    // Debian's packages leave modules.dep to their postinst; virtme-ng needs it to pick the
    // modules (virtio, 9p) its initramfs loads. Packages from trixie on keep them in /usr
    // (this machine's depmod looks under BASE/lib only).
    let version = version(&image)?;
    let base = if root.join("lib/modules").exists() {
        root.clone()
    } else {
        root.join("usr")
    };
    quiet(
        Command::new("depmod").arg("-b").arg(base).arg(version),
        "depmod",
    )?;
    let names: Vec<String> = files
        .iter()
        .map(|f| f.file_name().unwrap_or_default().to_string_lossy() + "\n")
        .map(String::from)
        .collect();
    fs::write(&stamp, names.concat())?;
    fs::remove_dir_all(&debs)?;
    Ok(image)
}

/// The kernel release of an image: in its name (`boot/vmlinuz-6.1.0-37-amd64`), or its
/// directory's (`usr/lib/modules/7.2.13+deb14-amd64/vmlinuz`).
fn version(image: &Path) -> Result<&str> {
    let name = image.file_name().and_then(|n| n.to_str());
    let release = match name {
        Some("vmlinuz") => image
            .parent()
            .and_then(|d| d.file_name())
            .and_then(|n| n.to_str()),
        _ => name.and_then(|n| n.strip_prefix("vmlinuz-")),
    };
    release.with_context(|| format!("no kernel release in {}", image.display()))
}

/// `boot/vmlinuz-RELEASE`, or from 7.x on (sid) `usr/lib/modules/RELEASE/vmlinuz`.
fn find_image(root: &Path) -> Result<Option<PathBuf>> {
    let mut found = Vec::new();
    for (dir, nested) in [
        ("boot", false),
        ("usr/lib/modules", true),
        ("lib/modules", true),
    ] {
        let Ok(entries) = fs::read_dir(root.join(dir)) else {
            continue;
        };
        for entry in entries {
            let path = entry?.path();
            if nested {
                found.push(path.join("vmlinuz"));
            } else if path
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
            {
                found.push(path);
            }
        }
    }
    Ok(found.into_iter().find(|p| p.is_file()))
}

/// The image package [`FLAVOUR`] depends on in the kernel's suite and the packages of that
/// release it is split into, after updating the private lists under `apt`.
fn resolve(kernel: &Kernel, apt: &Path) -> Result<Vec<String>> {
    update(apt, kernel.suite, "amd64", "tracer-kernels")?;
    let depends = |package: &str| -> Result<Vec<String>> {
        let text = quiet(
            apt_tool("apt-cache", apt).args(["depends", package]),
            "apt-cache depends",
        )?;
        Ok(parse_depends(&text))
    };
    let image = depends(FLAVOUR)?
        .into_iter()
        .find(|p| p.starts_with("linux-image-"))
        .with_context(|| format!("{FLAVOUR} in {} depends on no linux-image", kernel.suite))?;
    // From 7.x on (sid) the image package only depends on linux-binary-RELEASE (vmlinuz) and
    // linux-modules-RELEASE; earlier ones hold both themselves.
    let release = image.trim_start_matches("linux-image-").to_owned();
    let mut packages = vec![image.clone()];
    packages.extend(
        depends(&image)?
            .into_iter()
            .filter(|p| p.starts_with("linux-") && p.ends_with(&release)),
    );
    Ok(packages)
}

/// The packages `apt-cache depends` names as dependencies (`  Depends: linux-image-6.1.0-37-amd64`,
/// `  |Depends: dracut`), alternatives included.
fn parse_depends(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.trim().trim_start_matches('|').strip_prefix("Depends:"))
        .map(|p| p.trim().to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depends_names_the_image() {
        let text = "linux-image-amd64\n  Depends: linux-image-6.1.0-37-amd64\n";
        assert_eq!(parse_depends(text), ["linux-image-6.1.0-37-amd64"]);
        assert!(parse_depends("linux-image-amd64\n").is_empty());
        let split =
            "linux-image-7.2.13+deb14-amd64\n |Depends: dracut\n  Depends: initramfs-tools\n  \
                     Depends: linux-binary-7.2.13+deb14-amd64\n";
        assert_eq!(
            parse_depends(split),
            [
                "dracut",
                "initramfs-tools",
                "linux-binary-7.2.13+deb14-amd64"
            ]
        );
    }

    #[test]
    fn version_from_image_name() {
        let image = Path::new("root/boot/vmlinuz-6.12.48+deb13-amd64");
        assert_eq!(version(image).unwrap(), "6.12.48+deb13-amd64");
        let image = Path::new("root/usr/lib/modules/7.2.13+deb14-amd64/vmlinuz");
        assert_eq!(version(image).unwrap(), "7.2.13+deb14-amd64");
    }
}
