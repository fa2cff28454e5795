//! Records the commit the binary is built from (`FLASHSALE_COMMIT`), for
//! `flashsale_build_info` and the load test's reports: a figure is worth as much as
//! knowing what produced it. Outside a git checkout (a Docker build context without
//! `.git`) it is "unknown".

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(output.stdout).ok()?;
    output.status.success().then(|| text.trim().to_owned())
}

fn main() {
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=FLASHSALE_COMMIT={commit}");
    // Built again when HEAD moves: a checkout (HEAD) or a commit (the branch's ref).
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        println!("cargo:rerun-if-changed={dir}/HEAD");
    }
    if let Some(dir) = git(&["rev-parse", "--git-common-dir"]) {
        println!("cargo:rerun-if-changed={dir}/refs/heads");
        // Only when it exists: cargo counts a missing file as changed, and so built the
        // crate again at every command in a checkout whose refs were never packed.
        let packed = format!("{dir}/packed-refs");
        if std::path::Path::new(&packed).exists() {
            println!("cargo:rerun-if-changed={packed}");
        }
    }
}
