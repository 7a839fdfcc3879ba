//! tracerd's configuration file (`/etc/tracer/tracerd.toml` unless `--config` names another):
//! every flag as a setting of the same name in snake case (`state_dir = "/var/lib/tracer"`,
//! `per_probe_uprobes = true`). Flags given on the command line win over the file. Each
//! setting's value is checked by the flag's own parser before anything starts, and an error
//! names the file and the key.
//!
//! The file is taken only from root (see `remote::trusted`: a regular file of at most 1 MiB,
//! that nobody else may change), and its values are bounded before clap sees them: strings
//! to `MAX_TEXT` bytes without NUL, numbers to the daemon's own bounds. A bad file stops
//! tracerd with one line naming the file, the key and the bound; nothing is clamped.

use std::{
    ffi::OsString,
    path::{Path, PathBuf},
};

use clap::CommandFactory;
use tracer_daemon::{error::clip, remote::trusted};

/// Where the file is looked for when `--config` is not given (its absence is no error).
pub const DEFAULT_PATH: &str = "/etc/tracer/tracerd.toml";

/// Flags that are not settings: what to read, and one-off actions.
const NOT_SETTINGS: &[&str] = &[
    "config",
    "check_config",
    "show_python_probes",
    "check_programs",
    "generate_man",
    "help",
    "version",
];

/// The longest string a setting may have: a path fits (PATH_MAX).
const MAX_TEXT: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error(transparent)]
    File(#[from] trusted::TrustedFileError),
    #[error("{}: {why}", path.display())]
    Invalid { path: PathBuf, why: String },
}

/// The command line with the file's settings before the user's flags (`args_override_self`
/// lets the later, the user's, win), the file read, if any, and the settings it gave.
pub struct Merged {
    pub argv: Vec<OsString>,
    pub file: Option<PathBuf>,
    keys: Keys,
}

pub fn merged<A: CommandFactory>(
    argv: Vec<OsString>,
    named: Option<&Path>,
) -> Result<Merged, SettingsError> {
    let path = match named {
        Some(p) => p.to_path_buf(),
        None if Path::new(DEFAULT_PATH).exists() => PathBuf::from(DEFAULT_PATH),
        None => {
            return Ok(Merged {
                argv,
                file: None,
                keys: Vec::new(),
            })
        }
    };
    let text = trusted::read_text(&path)?;
    let (flags, keys) = flags::<A>(&text).map_err(|why| SettingsError::Invalid {
        path: path.clone(),
        why,
    })?;
    let mut out = Vec::with_capacity(argv.len() + flags.len());
    let mut user = argv.into_iter();
    out.extend(user.next());
    out.extend(flags);
    out.extend(user);
    Ok(Merged {
        argv: out,
        file: Some(path),
        keys,
    })
}

impl Merged {
    /// A parse error where a file was read, in one line: naming the file and the key when
    /// the value was the file's. None: no file (clap's own message then).
    pub fn explain(&self, e: &clap::Error) -> Option<String> {
        use clap::error::{ContextKind, ContextValue};
        let file = self.file.as_ref()?.display();
        let msg = e.to_string();
        // clap's message up to its usage lines, on one line.
        let text = msg
            .lines()
            .take_while(|l| !l.trim().is_empty())
            .map(|l| l.trim().trim_start_matches("error: "))
            .collect::<Vec<_>>()
            .join(" ");
        // clap echoes the value: up to MAX_TEXT bytes of the file's.
        let text = clip(&text, 512);
        let key = match e.get(ContextKind::InvalidArg) {
            Some(ContextValue::String(arg)) => arg
                .strip_prefix("--")
                .and_then(|a| a.split([' ', '=']).next())
                .and_then(|long| self.keys.iter().find(|(_, l)| l == long)),
            _ => None,
        };
        Some(match key {
            Some((key, _)) => format!("{file}: {key}: {text}"),
            None => format!("{text} (settings from {file} and the command line)"),
        })
    }
}

/// (setting, its flag's long name) of each setting a file gave.
type Keys = Vec<(String, String)>;

/// The file's settings as flags, and (setting, long name) of each.
fn flags<A: CommandFactory>(text: &str) -> Result<(Vec<OsString>, Keys), String> {
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        // toml's message spans lines (a snippet of the file); one line is kept.
        e.message().lines().next().unwrap_or("not TOML").to_owned()
    })?;
    let cmd = A::command();
    let (mut out, mut keys) = (Vec::new(), Vec::new());
    for (key, value) in &table {
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_id().as_str() == key && !NOT_SETTINGS.contains(&key.as_str()))
            .ok_or_else(|| {
                let hint = if key.contains('-') {
                    format!(
                        " (settings are written with '_': {})",
                        key.replace('-', "_")
                    )
                } else {
                    String::new()
                };
                format!("unknown setting {}{hint}", clip(key, 64))
            })?;
        let long = arg
            .get_long()
            .ok_or_else(|| format!("{key} is not a setting"))?;
        keys.push((key.clone(), long.to_owned()));
        let takes_value = arg.get_action().takes_values();
        let text = match value {
            toml::Value::Boolean(b) if !takes_value => {
                if *b {
                    out.push(OsString::from(format!("--{long}")));
                }
                continue;
            }
            toml::Value::String(s) if takes_value => {
                if s.len() > MAX_TEXT {
                    return Err(format!("{key}: {} bytes; at most {MAX_TEXT}", s.len()));
                }
                if s.contains('\0') {
                    return Err(format!("{key}: holds a NUL character"));
                }
                s.clone()
            }
            toml::Value::Integer(i) if takes_value => {
                if let Some(why) = tracer_daemon::daemon::bound(key, *i) {
                    return Err(format!("{key}: {why}"));
                }
                i.to_string()
            }
            _ if takes_value => return Err(format!("{key} must be a string or a number")),
            _ => return Err(format!("{key} must be true or false")),
        };
        out.push(OsString::from(format!("--{long}={text}")));
    }
    Ok((out, keys))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser)]
    #[command(args_override_self = true)]
    struct Args {
        #[arg(long, default_value = "/run/x.sock")]
        socket: PathBuf,
        #[arg(long, default_value_t = 16)]
        trace_ring_mb: u32,
        #[arg(long)]
        per_probe_uprobes: bool,
        #[arg(long)]
        config: Option<PathBuf>,
        #[arg(long, hide = true)]
        generate_man: Option<PathBuf>,
    }

    #[test]
    fn settings_become_flags_that_the_command_line_overrides() {
        let (f, _) =
            flags::<Args>("socket = \"/a.sock\"\ntrace_ring_mb = 32\nper_probe_uprobes = true\n")
                .unwrap();
        // In the key's order (a TOML table's).
        assert_eq!(
            f,
            [
                "--per-probe-uprobes",
                "--socket=/a.sock",
                "--trace-ring-mb=32"
            ]
        );
        let mut argv: Vec<OsString> = vec!["tracerd".into()];
        argv.extend(f);
        argv.push("--socket=/b.sock".into());
        let a = <Args as clap::Parser>::try_parse_from(argv).unwrap();
        assert_eq!(
            (a.socket, a.trace_ring_mb, a.per_probe_uprobes),
            ("/b.sock".into(), 32, true)
        );
    }

    #[test]
    fn errors_name_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.toml");
        std::fs::write(&file, "trace_ring_mb = \"many\"\n").unwrap();
        let m = merged::<Args>(vec!["tracerd".into()], Some(&file)).unwrap();
        let e = <Args as clap::Parser>::try_parse_from(&m.argv)
            .err()
            .unwrap();
        let line = m.explain(&e).unwrap();
        assert!(
            line.starts_with(&format!(
                "{}: trace_ring_mb: invalid value 'many'",
                file.display()
            )),
            "{line}"
        );
        assert!(!line.contains('\n'));
        let err = |t: &str| flags::<Args>(t).unwrap_err();
        assert_eq!(
            err("trace-ring-mb = 4"),
            "unknown setting trace-ring-mb (settings are written with '_': trace_ring_mb)"
        );
        assert_eq!(err("config = \"x\""), "unknown setting config");
        assert_eq!(
            err("per_probe_uprobes = 1"),
            "per_probe_uprobes must be true or false"
        );
        assert_eq!(err("socket = true"), "socket must be a string or a number");
        assert!(!err("socket = ").contains('\n'));
        assert!(merged::<Args>(vec![], Some(&dir.path().join("none"))).is_err());
    }

    #[test]
    fn hostile_values_are_refused_naming_the_key_and_the_bound() {
        let err = |t: &str| flags::<Args>(t).unwrap_err();
        for (n, text) in [
            ("-1", "-1"),
            ("0", "0"),
            ("3", "3"),
            ("2048", "2048"),
            ("9223372036854775807", "9223372036854775807"),
        ] {
            assert_eq!(
                err(&format!("trace_ring_mb = {n}")),
                format!("trace_ring_mb: wants a power of two from 1 to 1024, got {text}")
            );
        }
        assert!(flags::<Args>("trace_ring_mb = 1024").is_ok());
        // Past i64: TOML's own error, on one line.
        let e = err("trace_ring_mb = 99999999999999999999");
        assert!(!e.contains('\n') && !e.is_empty(), "{e}");
        let long = "a".repeat(MAX_TEXT + 1);
        assert_eq!(
            err(&format!("socket = \"{long}\"")),
            format!("socket: {} bytes; at most {MAX_TEXT}", MAX_TEXT + 1)
        );
        assert!(flags::<Args>(&format!("socket = \"/{}\"", "a".repeat(MAX_TEXT - 1))).is_ok());
        assert_eq!(
            err("socket = \"/a\\u0000b\""),
            "socket: holds a NUL character"
        );
        for wrong in [
            "socket = 1.5",
            "socket = [\"/a\"]",
            "socket = { path = \"/a\" }",
            "socket = 1979-05-27T07:32:00Z",
            "[socket]\npath = \"/a\"",
        ] {
            assert_eq!(err(wrong), "socket must be a string or a number", "{wrong}");
        }
        assert_eq!(
            err("per_probe_uprobes = \"yes\""),
            "per_probe_uprobes must be true or false"
        );
        // A flag that is an action, not a setting: a daemon that writes a man page and exits.
        assert_eq!(
            err("generate_man = \"/tmp\""),
            "unknown setting generate_man"
        );
        // What is echoed stays short.
        let e = err(&format!("{} = 1", "k".repeat(100_000)));
        assert!(e.len() < 200, "{}", e.len());
        let e = err("socket = \"/a\"\nsocket = \"/b\"");
        assert!(e.contains("duplicate key") && !e.contains('\n'), "{e}");
        // Nesting deep enough to overflow a recursive parser's stack: refused, on one line.
        for deep in [
            format!("socket = {}{}", "[".repeat(500_000), "]".repeat(500_000)),
            format!("socket = {}1{}", "{a=".repeat(500_000), "}".repeat(500_000)),
            format!("{} = 1", vec!["a"; 500_000].join(".")),
        ] {
            let e = err(&deep);
            assert!(!e.contains('\n') && !e.is_empty(), "{e}");
        }
    }

    #[test]
    fn files_that_are_not_root_s_settings_are_refused_at_once() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let started = std::time::Instant::now();
        let fifo = dir.path().join("fifo.toml");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let m = |p: &Path| {
            merged::<Args>(vec!["tracerd".into()], Some(p))
                .err()
                .unwrap()
                .to_string()
        };
        assert!(m(&fifo).ends_with("not a regular file (a FIFO)"));
        assert!(m(Path::new("/dev/zero")).ends_with("not a regular file (a character device)"));
        let big = dir.path().join("big.toml");
        std::fs::write(&big, "#".repeat(2 << 20)).unwrap();
        assert!(m(&big).contains("larger than 1024 KiB"));
        let open = dir.path().join("open.toml");
        std::fs::write(&open, "trace_ring_mb = 32\n").unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = m(&open);
        assert!(
            e.contains("writable by its group or others, mode 666"),
            "{e}"
        );
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(merged::<Args>(vec!["tracerd".into()], Some(&open)).is_ok());
        std::fs::write(&open, "trace_ring_mb = 3\n").unwrap();
        assert_eq!(
            m(&open),
            format!(
                "{}: trace_ring_mb: wants a power of two from 1 to 1024, got 3",
                open.display()
            )
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
    }
}
