//! The book (`docs/`) documents the binary users run.
//!
//! `make docs-check` proves every link of the built book resolves; these tests prove the book
//! keeps up with the binary: a flag added to a command without a line in the command-line
//! reference fails here.

use std::path::PathBuf;

/// Every command whose flags the reference documents, as its arguments before `--help`.
const COMMANDS: [&[&str]; 8] = [
    &[],
    &["serve"],
    &["up"],
    &["engine"],
    &["bench"],
    &["policy", "check"],
    &["policy", "plan"],
    &["policy", "new"],
];

/// The page that lists every flag of every command.
const REFERENCE: &str = "docs/src/reference.md";

fn checkout_file(path: &str) -> String {
    let path: PathBuf = switchyard_tests::checkout().join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The long flags `switchyard <command> --help` lists (`--port <PORT>`, `-h, --help`), less
/// the two every command has.
fn flags_of(command: &[&str]) -> Vec<String> {
    let out = std::process::Command::new(switchyard_tests::switchyard_bin())
        .args(command)
        .arg("--help")
        .output()
        .expect("switchyard runs");
    assert!(out.status.success(), "switchyard {command:?} --help failed");
    let help = String::from_utf8_lossy(&out.stdout);
    help.lines()
        .map(str::trim_start)
        .filter(|line| line.starts_with('-'))
        .filter_map(|line| {
            let flag = line
                .split_whitespace()
                .find(|word| word.starts_with("--"))?;
            let name = flag.trim_end_matches(',').split('=').next()?;
            Some(name.to_owned())
        })
        .filter(|flag| flag != "--help" && flag != "--version")
        .collect()
}

/// Whether `page` names `flag` in code: `` `--flag` ``, `` `--flag VALUE` ``, `` `--flag=…` ``,
/// not merely a longer flag that starts with it.
fn documents(page: &str, flag: &str) -> bool {
    let quoted = format!("`{flag}");
    page.match_indices(&quoted).any(|(at, _)| {
        page[at + quoted.len()..]
            .chars()
            .next()
            .is_some_and(|next| !(next.is_ascii_alphanumeric() || next == '-'))
    })
}

#[test]
fn every_flag_of_every_command_is_in_the_command_line_reference() {
    let reference = checkout_file(REFERENCE);
    let mut missing = Vec::new();
    for command in COMMANDS {
        let flags = flags_of(command);
        assert!(
            !flags.is_empty(),
            "switchyard {command:?} --help lists no flag: the parser above no longer reads it"
        );
        missing.extend(
            flags
                .into_iter()
                .filter(|flag| !documents(&reference, flag))
                .map(|flag| format!("switchyard {} {flag}", command.join(" "))),
        );
    }
    assert!(
        missing.is_empty(),
        "{REFERENCE} documents none of: {missing:?}"
    );
}

#[test]
fn the_flag_check_tells_a_documented_flag_from_a_longer_one() {
    let page = "| `--model-dir` | … | `--workers 3` | `--engine-arg=--x`";
    assert!(documents(page, "--model-dir"));
    assert!(documents(page, "--workers"));
    assert!(documents(page, "--engine-arg"));
    assert!(
        !documents(page, "--model"),
        "`--model-dir` is not `--model`"
    );
    assert!(!documents(page, "--work"));
}
