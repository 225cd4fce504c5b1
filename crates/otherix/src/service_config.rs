//! Settings of the long-running roles, `otherix server` and `otherix agent`, from
//! three places besides their flags: a TOML config file, the environment, and the
//! built-in defaults. Precedence: flags > environment > file > defaults.
//!
//! The clap definitions in `cli.rs` stay the single list of settings: every flag
//! of `ServerArgs`/`AgentArgs` is a file key (its long name, `-` written `_`) and
//! an environment variable ([`env::flag`]), with no table to keep in step. This
//! works by adjusting the parsed command before parsing: the file's values become
//! the flags' defaults (which clap ranks below the environment and the command
//! line), and each flag gets its environment variable.
//!
//! `--print-config` prints the effective settings and where each came from.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context};
use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Command, CommandFactory, FromArgMatches};
use serde::Serialize;

use crate::cli::Cli;
use crate::env;

/// A role that reads a config file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Server,
    Agent,
}

impl Role {
    fn from_subcommand(name: &str) -> Option<Role> {
        match name {
            "server" => Some(Role::Server),
            "agent" => Some(Role::Agent),
            _ => None,
        }
    }

    fn subcommand(self) -> &'static str {
        match self {
            Role::Server => "server",
            Role::Agent => "agent",
        }
    }

    fn env_prefix(self) -> &'static str {
        match self {
            Role::Server => env::SERVER_FLAG_PREFIX,
            Role::Agent => env::AGENT_FLAG_PREFIX,
        }
    }

    fn config_env(self) -> &'static str {
        match self {
            Role::Server => env::SERVER_CONFIG,
            Role::Agent => env::AGENT_CONFIG,
        }
    }

    /// Read when it exists and no other file is named.
    pub fn default_config(self) -> &'static Path {
        match self {
            Role::Server => Path::new("/etc/otherix/server.toml"),
            Role::Agent => Path::new("/etc/otherix/agent.toml"),
        }
    }
}

/// The flags of the config-file machinery itself: neither file keys nor
/// environment-settable through the common rule.
const OWN_FLAGS: &[&str] = &["config", "print_config"];

/// The command line, with the file and environment of `server` and `agent` applied.
#[derive(Debug)]
pub struct Parsed {
    pub cli: Cli,
    /// Set when `--print-config` asked for the effective settings instead of a run.
    pub print: Option<Effective>,
}

/// What `--print-config` prints.
#[derive(Debug, Serialize)]
pub struct Effective {
    /// The config file read, if any.
    pub config_file: Option<PathBuf>,
    /// Every setting by file key.
    pub settings: BTreeMap<String, Setting>,
}

#[derive(Debug, Serialize)]
pub struct Setting {
    /// As given, `null` when unset.
    pub value: Option<Value>,
    pub source: Source,
}

/// A setting's value as `--print-config` shows it.
#[derive(Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Value {
    /// A switch (`--hypervisor`).
    Switch(bool),
    /// A flag that takes one value; a secret is shown as `"<hidden>"`.
    One(String),
    /// A repeatable flag (`--san`), every value given.
    Many(Vec<String>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Flag,
    Env,
    File,
    Default,
    Unset,
}

/// Exits with clap's error `e`, and a hint where a common slip caused it:
/// `otherix ssh VM -o Opt=v` gives ssh's `-o` to otherix's output flag.
fn exit_with_hint(argv: &[OsString], e: clap::Error) -> ! {
    let ssh = argv.iter().skip(1).any(|a| a == "ssh");
    if ssh && e.kind() == clap::error::ErrorKind::InvalidValue && e.to_string().contains("--output") {
        let _ = e.print();
        eprintln!("hint: ssh's own options go after `--`: otherix ssh web01 -- -o BatchMode=yes");
        std::process::exit(2);
    }
    e.exit()
}

/// Parses `argv` like `Cli::parse` does (clap's own errors, `--help` and
/// `--version` exit the process), reading the config file and environment for
/// `server` and `agent`. Errors are about the config file.
pub fn parse(argv: Vec<OsString>) -> anyhow::Result<Parsed> {
    // A first, forgiving pass only to learn the subcommand and its --config: a
    // required flag may well come from the file. Without --help and --version,
    // which would end it early (the real pass shows them, with the file's values).
    let probe = argv
        .iter()
        .filter(|a| !matches!(a.to_str(), Some("-h" | "--help" | "-V" | "--version")));
    let first = Cli::command().ignore_errors(true).try_get_matches_from(probe);
    let role_and_matches = first
        .as_ref()
        .ok()
        .and_then(|m| m.subcommand())
        .and_then(|(name, sub)| Some((Role::from_subcommand(name)?, sub)));
    let Some((role, first_sub)) = role_and_matches else {
        let mut cmd = crate::cli::command();
        let matches = cmd
            .try_get_matches_from_mut(&argv)
            .unwrap_or_else(|e| exit_with_hint(&argv, e));
        refuse_misplaced(&mut cmd, &matches);
        return Ok(Parsed {
            cli: from_matches(&matches),
            print: None,
        });
    };

    let config_file = config_path(role, first_sub)?;
    let file = match &config_file {
        Some(path) => load(path)?,
        None => toml::Table::new(),
    };
    let mut sub = Cli::command()
        .find_subcommand(role.subcommand())
        .cloned()
        .expect("server and agent are subcommands of Cli");
    let keys = file_keys(&sub);
    let mut from_file = BTreeSet::new();
    for (key, value) in &file {
        let path = config_file.as_deref().unwrap_or(Path::new("?"));
        let Some(id) = keys.get(key) else {
            bail!(
                "unknown key `{key}` in {}\nhint: the keys are the flags of `otherix {}` (see --help), \
                 `-` written `_`: {}",
                path.display(),
                role.subcommand(),
                keys.keys().cloned().collect::<Vec<_>>().join(", ")
            );
        };
        let arg = sub
            .get_arguments()
            .find(|a| a.get_id() == id)
            .expect("a key is an argument");
        let values = file_values(arg, value).with_context(|| format!("key `{key}` in {}", path.display()))?;
        check_values(arg, &values).with_context(|| format!("key `{key}` in {}", path.display()))?;
        let id = id.clone();
        sub = sub.mut_arg(&id, |a| a.default_values(values).required(false));
        from_file.insert(id);
    }
    for id in keys.values() {
        sub = sub.mut_arg(id, |a| with_env(role, a));
    }

    let mut cmd = crate::cli::shape(Cli::command().mut_subcommand(role.subcommand(), |_| sub));
    let matches = cmd
        .try_get_matches_from_mut(&argv)
        .unwrap_or_else(|e| exit_with_hint(&argv, e));
    refuse_misplaced(&mut cmd, &matches);
    let cli = from_matches(&matches);
    let (_, sub_matches) = matches.subcommand().expect("the subcommand was found above");
    let print = sub_matches
        .get_flag("print_config")
        .then(|| effective(role, &matches, config_file, &from_file));
    Ok(Parsed { cli, print })
}

/// A usage error (exit 2) for a global option given to a command it does
/// not apply to (`otherix server -o json`).
fn refuse_misplaced(cmd: &mut Command, matches: &ArgMatches) {
    if let Some(msg) = crate::cli::misplaced(matches) {
        cmd.error(clap::error::ErrorKind::ArgumentConflict, msg).exit();
    }
}

fn from_matches(matches: &ArgMatches) -> Cli {
    Cli::from_arg_matches(matches).unwrap_or_else(|e| e.exit())
}

/// The file named by `--config`, else by the role's environment variable, else
/// the default path if it exists. A named file must exist.
///
/// Not clap's value of `config`: the client's global `--config` shares the id,
/// so the client's `OTHERIX_CONFIG` would arrive through it.
fn config_path(role: Role, sub: &ArgMatches) -> anyhow::Result<Option<PathBuf>> {
    let named = if sub.value_source("config") == Some(ValueSource::CommandLine) {
        sub.get_one::<PathBuf>("config").cloned()
    } else {
        std::env::var_os(role.config_env())
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    match named {
        Some(path) => Ok(Some(path)),
        None => Ok(Some(role.default_config().to_path_buf()).filter(|p| p.exists())),
    }
}

fn load(path: &Path) -> anyhow::Result<toml::Table> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading config file {}", path.display()))?;
    text.parse::<toml::Table>().map_err(|e| {
        let line = e.span().map_or(1, |s| text[..s.start].lines().count().max(1));
        anyhow!("{} line {line}: {}", path.display(), e.message())
    })
}

/// File key → argument id, for the subcommand's own settings.
fn file_keys(sub: &Command) -> BTreeMap<String, clap::Id> {
    sub.get_arguments()
        .filter(|a| !a.is_global_set() && !OWN_FLAGS.contains(&a.get_id().as_str()))
        .filter_map(|a| Some((a.get_long()?.replace('-', "_"), a.get_id().clone())))
        .filter(|(long, _)| long != "help")
        .collect()
}

/// Gives a setting its environment variable (the rule in [`env::flag`]), and
/// lets repeatable settings take a comma-separated list there.
fn with_env(role: Role, arg: Arg) -> Arg {
    let Some(long) = arg.get_long() else { return arg };
    let name = env::flag(role.env_prefix(), long);
    let repeatable = matches!(arg.get_action(), ArgAction::Append);
    let arg = arg.env(name);
    if repeatable {
        arg.value_delimiter(',')
    } else {
        arg
    }
}

/// A TOML value as the command-line words clap would be given.
fn file_values(arg: &Arg, value: &toml::Value) -> anyhow::Result<Vec<String>> {
    let scalar = |v: &toml::Value| match v {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) => Ok(i.to_string()),
        toml::Value::Float(f) => Ok(f.to_string()),
        other => Err(anyhow!(
            "expected a string or a number, found {}",
            other.type_str()
        )),
    };
    match (arg.get_action(), value) {
        (ArgAction::SetTrue, toml::Value::Boolean(b)) => Ok(vec![b.to_string()]),
        (ArgAction::SetTrue, other) => bail!("expected true or false, found {}", other.type_str()),
        (ArgAction::Append, toml::Value::Array(items)) => items.iter().map(scalar).collect(),
        (ArgAction::Append, single) => Ok(vec![scalar(single)?]),
        (_, v) => Ok(vec![scalar(v)?]),
    }
}

/// Runs the flag's own value parser over file values, so that a bad value is
/// refused naming the key and file (clap would blame the flag).
fn check_values(arg: &Arg, values: &[String]) -> anyhow::Result<()> {
    if matches!(arg.get_action(), ArgAction::SetTrue) {
        return Ok(());
    }
    let long = arg.get_long().expect("file keys have long names");
    let probe = Arg::new("value")
        .long(long.to_owned())
        .value_names(arg.get_value_names().unwrap_or_default().to_vec())
        .action(ArgAction::Append)
        .value_parser(arg.get_value_parser().clone());
    let words = values.iter().flat_map(|v| [format!("--{long}"), v.clone()]);
    Command::new("otherix")
        .no_binary_name(true)
        .arg(probe)
        .try_get_matches_from(words)
        .map(drop)
        .map_err(|e| {
            let text = e.to_string();
            let first = text.lines().next().unwrap_or_default();
            anyhow!("{}", first.trim_start_matches("error: "))
        })
}

fn effective(
    role: Role,
    matches: &ArgMatches,
    config_file: Option<PathBuf>,
    from_file: &BTreeSet<clap::Id>,
) -> Effective {
    let cmd = Cli::command();
    let sub_cmd = cmd
        .find_subcommand(role.subcommand())
        .expect("a subcommand of Cli");
    let (_, sub) = matches.subcommand().expect("the role's subcommand");
    let settings = file_keys(sub_cmd)
        .into_iter()
        .map(|(key, id)| {
            let arg = sub_cmd
                .get_arguments()
                .find(|a| a.get_id() == &id)
                .expect("a key is an argument");
            let raw: Vec<String> = sub
                .get_raw(id.as_str())
                .map(|vals| vals.map(|v| v.to_string_lossy().into_owned()).collect())
                .unwrap_or_default();
            // A file's empty list (`san = []`) leaves clap no value at all.
            let source = match (sub.value_source(id.as_str()), from_file.contains(&id)) {
                (Some(ValueSource::CommandLine), _) => Source::Flag,
                (Some(ValueSource::EnvVariable), _) => Source::Env,
                (_, true) => Source::File,
                (Some(ValueSource::DefaultValue), false) => Source::Default,
                _ => Source::Unset,
            };
            let value = match arg.get_action() {
                _ if source == Source::Unset => None,
                _ if arg.is_hide_env_values_set() => Some(Value::One("<hidden>".into())),
                ArgAction::SetTrue => Some(Value::Switch(raw.first().is_some_and(|v| v == "true"))),
                ArgAction::Append => Some(Value::Many(raw)),
                _ => raw.into_iter().next().map(Value::One),
            };
            (key, Setting { value, source })
        })
        .collect();
    Effective {
        config_file,
        settings,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_print_as_plain_json() {
        let show = |value| {
            serde_json::to_string(&Setting {
                value,
                source: Source::File,
            })
            .unwrap()
        };
        assert_eq!(show(None), r#"{"value":null,"source":"file"}"#);
        assert_eq!(
            show(Some(Value::Switch(true))),
            r#"{"value":true,"source":"file"}"#
        );
        assert_eq!(
            show(Some(Value::One("10s".into()))),
            r#"{"value":"10s","source":"file"}"#
        );
        assert_eq!(
            show(Some(Value::Many(vec!["a".into(), "b".into()]))),
            r#"{"value":["a","b"],"source":"file"}"#
        );
    }

    #[test]
    fn every_setting_of_both_roles_is_a_file_key() {
        for role in [Role::Server, Role::Agent] {
            let cmd = Cli::command();
            let sub = cmd.find_subcommand(role.subcommand()).unwrap();
            let keys = file_keys(sub);
            assert!(!keys.contains_key("config") && !keys.contains_key("print_config"));
            assert!(keys.contains_key("data_dir"), "{role:?}: {keys:?}");
            let long_flags = sub
                .get_arguments()
                .filter(|a| !a.is_global_set() && a.get_long().is_some_and(|l| l != "help"))
                .count();
            assert_eq!(keys.len() + OWN_FLAGS.len(), long_flags, "{role:?}");
        }
    }
}
