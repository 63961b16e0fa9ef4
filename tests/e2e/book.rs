//! The book (`docs/`) documents the binary users run, and the README stays its front door.
//!
//! `make docs-check` proves every link of the built book resolves; these tests prove the book
//! keeps up with the binary: a flag added to a command without a line in the command-line
//! reference fails here.

use std::path::PathBuf;

/// The page that lists every flag of every command.
const REFERENCE: &str = "docs/src/reference.md";

/// The longest the README may grow: what a newcomer reads before the book takes over.
const README_MAX_LINES: usize = 300;

/// A file of the checkout, such as a page of the book (`docs/src/…`).
pub(crate) fn checkout_file(path: &str) -> String {
    let path: PathBuf = switchyard_tests::checkout().join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `switchyard <command> --help`.
fn help(command: &[String]) -> String {
    let out = std::process::Command::new(switchyard_tests::switchyard_bin())
        .args(command)
        .arg("--help")
        .output()
        .expect("switchyard runs");
    assert!(out.status.success(), "switchyard {command:?} --help failed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Every command of the binary, as its arguments before `--help`: the binary itself and each
/// subcommand its help lists under `Commands:`, recursively, so a command added to the binary is
/// checked without being named here.
fn commands() -> Vec<Vec<String>> {
    let mut found = vec![Vec::new()];
    let mut next = 0;
    while let Some(command) = found.get(next).cloned() {
        next += 1;
        let help = help(&command);
        let listed = help
            .lines()
            .skip_while(|line| !line.starts_with("Commands:"))
            .skip(1)
            .take_while(|line| line.starts_with(' '))
            .filter_map(|line| line.split_whitespace().next())
            .filter(|name| *name != "help");
        for name in listed {
            let mut sub = command.clone();
            sub.push(name.to_owned());
            found.push(sub);
        }
    }
    found
}

/// The long flags `switchyard <command> --help` lists (`--port <PORT>`, `-h, --help`), less
/// the two every command has.
fn flags_of(command: &[String]) -> Vec<String> {
    help(command)
        .lines()
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
    let commands = commands();
    // The binary, serve, up, engine, bench, trace, policy and its three subcommands at least.
    assert!(
        commands.len() >= 10,
        "found only {commands:?}: the help parser above no longer reads `Commands:`"
    );
    for command in &commands {
        let flags = flags_of(command);
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

#[test]
fn the_readme_is_a_front_door_into_the_book() {
    let readme = checkout_file("README.md");
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines (at most {README_MAX_LINES}): move the detail into docs/src"
    );
    for command in ["make run", "make test"] {
        assert!(
            readme.contains(command),
            "README.md does not give `{command}`"
        );
    }
    // Every chapter of the book is one link away from the README.
    let summary = checkout_file("docs/src/SUMMARY.md");
    let chapters: Vec<&str> = summary
        .lines()
        .filter_map(|line| line.split_once("](")?.1.split_once(')'))
        .map(|(target, _)| target)
        .filter(|target| *target != "introduction.md")
        .collect();
    assert!(!chapters.is_empty(), "docs/src/SUMMARY.md lists no chapter");
    let unlinked: Vec<_> = chapters
        .iter()
        .filter(|chapter| !readme.contains(&format!("](docs/src/{chapter}")))
        .collect();
    assert!(
        unlinked.is_empty(),
        "README.md links to none of these chapters: {unlinked:?}"
    );
}
