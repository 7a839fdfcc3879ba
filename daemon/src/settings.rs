//! tracerd's configuration file (`/etc/tracer/tracerd.toml` unless `--config` names another):
//! every flag as a setting of the same name in snake case (`state_dir = "/var/lib/tracer"`,
//! `per_probe_uprobes = true`). Flags given on the command line win over the file. Each
//! setting's value is checked by the flag's own parser before anything starts, and an error
//! names the file and the key.

use std::{
    ffi::OsString,
    path::{Path, PathBuf},
};

use clap::CommandFactory;

/// Where the file is looked for when `--config` is not given (its absence is no error).
pub const DEFAULT_PATH: &str = "/etc/tracer/tracerd.toml";

/// Flags that are not settings: what to read, and one-off actions.
const NOT_SETTINGS: &[&str] = &[
    "config",
    "check_config",
    "show_python_probes",
    "check_programs",
    "help",
    "version",
];

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
) -> Result<Merged, String> {
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
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let (flags, keys) = flags::<A>(&text).map_err(|e| format!("{}: {e}", path.display()))?;
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
                format!("unknown setting {key}{hint}")
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
            toml::Value::String(s) if takes_value => s.clone(),
            toml::Value::Integer(i) if takes_value => i.to_string(),
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
}
