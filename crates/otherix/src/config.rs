//! The client configuration file: named contexts, each a control plane (its
//! URLs), the cluster CA to trust and a token, and which context is current
//! (kubectl's kubeconfig, in one file). Lives at
//! `$XDG_CONFIG_HOME/otherix/config.toml` (or `~/.config/...`);
//! `OTHERIX_CONFIG` / `--config` point elsewhere. A file of the older
//! single-login format reads as one context, [`MIGRATED`], and is written in
//! the new format by the next command that changes it.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context as _};
use serde::{Deserialize, Serialize};

use crate::env;

/// The name a single-login config file's login gets as a context.
pub const MIGRATED: &str = "default";

/// What `otherix login` needs, for the hints of errors that send people there.
const LOGIN_HINT: &str = "run `otherix login --server URL --token-file FILE --ca-fingerprint sha256:...`";

/// The whole file: every context, and the one commands use unless told.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The context commands use without `--context` / `OTHERIX_CONTEXT`;
    /// none after the current one was deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_context: Option<String>,
    /// Contexts by name.
    #[serde(default)]
    pub contexts: BTreeMap<String, Context>,
}

/// One control plane (or its replicas) and how to talk to it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Context {
    /// Control plane URL, or the URLs of its replicas (a list).
    pub server: Servers,
    /// `sha256:...` of the pinned cluster CA (for people; `ca_pem` is what is trusted).
    pub ca_fingerprint: String,
    /// The pinned cluster CA certificate.
    pub ca_pem: String,
    /// API token; none after `otherix logout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("server", &self.server)
            .field("ca_fingerprint", &self.ca_fingerprint)
            .field("token", &self.token.as_ref().map(|_| "<hidden>"))
            .finish_non_exhaustive()
    }
}

impl Config {
    /// The context a command uses: `explicit` (`--context`,
    /// `OTHERIX_CONTEXT`) if given, else the current one. `path` is for the
    /// error messages.
    pub fn select(&self, explicit: Option<&str>, path: &Path) -> anyhow::Result<(&str, &Context)> {
        let name = match (explicit, self.current_context.as_deref()) {
            (Some(name), _) | (None, Some(name)) => name,
            (None, None) if self.contexts.is_empty() => {
                bail!("not logged in: no context in {}\nhint: {LOGIN_HINT}", path.display())
            }
            (None, None) => bail!(
                "no current context in {}\nhint: choose one with `otherix context use NAME` or `--context NAME` ({})",
                path.display(),
                self.names()
            ),
        };
        self.get(name, path)
    }

    /// The context called `name`, or an error naming the ones there are.
    pub fn get(&self, name: &str, path: &Path) -> anyhow::Result<(&str, &Context)> {
        match self.contexts.get_key_value(name) {
            Some((name, context)) => Ok((name.as_str(), context)),
            None if self.contexts.is_empty() => bail!(
                "no context {name:?} in {}: it has none\nhint: {LOGIN_HINT} --name {name}",
                path.display()
            ),
            None => bail!(
                "no context {name:?} in {}\nhint: the contexts are {} (`otherix context list`)",
                path.display(),
                self.names()
            ),
        }
    }

    /// The name an `otherix login` without `--name` saves `servers` under:
    /// the context that already holds exactly these servers (the current one
    /// first), so logging in again updates it; else one derived from the
    /// first server's host ([`name_from_url`]).
    pub fn name_for(&self, servers: &[String]) -> String {
        let holds = |name: &String| self.contexts.get(name).is_some_and(|c| c.server.0 == servers);
        self.current_context
            .iter()
            .find(|name| holds(name))
            .or_else(|| self.contexts.keys().find(|name| holds(name)))
            .cloned()
            .unwrap_or_else(|| name_from_url(servers.first().map_or("", String::as_str)))
    }

    /// Lends the context `name` to someone for a while (`otherix dev`):
    /// what to put back when they are done with it.
    pub fn lend(&self, name: &str) -> Lent {
        Lent {
            name: name.to_string(),
            current: self.current_context.clone(),
            replaced: self.contexts.get(name).cloned(),
        }
    }

    /// Puts back what [`Config::lend`] noted: the context `name` as it was
    /// (or none), and the current context as it was, unless the current one
    /// was changed meanwhile to another that is still there.
    pub fn give_back(&mut self, lent: Lent) {
        match lent.replaced {
            Some(context) => {
                self.contexts.insert(lent.name.clone(), context);
            }
            None => {
                self.contexts.remove(&lent.name);
            }
        }
        let chosen_meanwhile = self
            .current_context
            .as_ref()
            .is_some_and(|c| *c != lent.name && self.contexts.contains_key(c));
        if !chosen_meanwhile {
            self.current_context = lent.current.filter(|c| self.contexts.contains_key(c));
        }
    }

    /// The context names, comma-separated, for messages.
    fn names(&self) -> String {
        self.contexts
            .keys()
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// What [`Config::lend`] noted.
#[derive(Debug)]
pub struct Lent {
    name: String,
    current: Option<String>,
    replaced: Option<Context>,
}

impl Lent {
    /// The context that was current when it was lent.
    pub fn previous(&self) -> Option<&str> {
        self.current.as_deref()
    }
}

/// A context's name: letters, digits and `.`, `_`, `-`, `:`, `@`, as a
/// host name or `user@host:port` is, up to 253 characters (a clap parser).
pub fn parse_name(name: &str) -> Result<String, String> {
    if name.is_empty() || name.len() > 253 {
        return Err("a context name is 1 to 253 characters".into());
    }
    match name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "._-:@".contains(*c)))
    {
        Some(c) => Err(format!(
            "{c:?} cannot be in a context name (letters, digits, `.`, `_`, `-`, `:`, `@`)"
        )),
        None => Ok(name.to_string()),
    }
}

/// The context name a server URL suggests: its host, and its port unless
/// that is the control plane's usual 7443 (`https://cp.example:7443` →
/// `cp.example`, `https://127.0.0.1:9000` → `127.0.0.1:9000`).
pub fn name_from_url(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let authority = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
    let (host, port) = match authority.strip_prefix('[') {
        // An IPv6 address: `[::1]:7443`.
        Some(v6) => match v6.split_once(']') {
            Some((host, port)) => (host, port.strip_prefix(':')),
            None => (v6, None),
        },
        None => match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        },
    };
    let name = match port {
        Some(port) if port != "7443" && !port.is_empty() => format!("{host}:{port}"),
        _ => host.to_string(),
    };
    let name: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-:@".contains(c) {
                c
            } else {
                '-'
            }
        })
        .take(253)
        .collect();
    if name.is_empty() {
        MIGRATED.to_string()
    } else {
        name
    }
}

/// One control plane URL, or several (replicas of one cluster; the client
/// uses the next when one does not answer). Written as a string when there
/// is one, as a list when there are more, so older configs read as before.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Servers(pub Vec<String>);

impl Servers {
    pub fn urls(&self) -> &Vec<String> {
        &self.0
    }
}

impl std::fmt::Display for Servers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.join(", "))
    }
}

impl Serialize for Servers {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0.as_slice() {
            [one] => s.serialize_str(one),
            many => many.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Servers {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum OneOrMany {
            One(String),
            Many(Vec<String>),
        }
        let urls = match OneOrMany::deserialize(d)? {
            OneOrMany::One(url) => vec![url],
            OneOrMany::Many(urls) => urls,
        };
        if urls.is_empty() {
            return Err(serde::de::Error::custom("`server` names no control plane"));
        }
        Ok(Servers(urls))
    }
}

/// Where the config lives: the explicit path, else the XDG location.
pub fn path(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = explicit {
        return Ok(p.to_path_buf());
    }
    let base = match std::env::var_os(env::XDG_CONFIG_HOME).filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => {
            let home = std::env::var_os(env::HOME)
                .filter(|v| !v.is_empty())
                .ok_or_else(|| {
                    anyhow!(
                        "neither {} nor {} is set; pass --config FILE",
                        env::XDG_CONFIG_HOME,
                        env::HOME
                    )
                })?;
            PathBuf::from(home).join(".config")
        }
    };
    Ok(base.join("otherix").join("config.toml"))
}

/// The file, or `None` when there is none. A file of the single-login
/// format reads as one context, [`MIGRATED`], made current.
pub fn load(path: &Path) -> anyhow::Result<Option<Config>> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    parse(&text)
        .map(Some)
        .with_context(|| format!("invalid client config {}", path.display()))
}

/// The file, or an error saying nobody logged in (with the hint to).
pub fn load_existing(path: &Path) -> anyhow::Result<Config> {
    load(path)?.ok_or_else(|| {
        anyhow!(
            "not logged in: no client config at {}\nhint: {LOGIN_HINT}",
            path.display()
        )
    })
}

/// The file's text as a [`Config`], whichever format it is in.
fn parse(text: &str) -> Result<Config, toml::de::Error> {
    let table: toml::Table = toml::from_str(text)?;
    if table.contains_key("server") {
        // The single-login format: one context's fields at the top.
        let single: Context = toml::from_str(text)?;
        return Ok(Config {
            current_context: Some(MIGRATED.to_string()),
            contexts: BTreeMap::from([(MIGRATED.to_string(), single)]),
        });
    }
    toml::from_str(text)
}

/// Writes the config atomically, readable by its owner only (it holds tokens).
pub fn save(path: &Path, config: &Config) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("creating {}", dir.display()))?;
    }
    let text = toml::to_string(config).context("encoding the client config")?;
    let tmp = path.with_extension("tmp");
    let _ = fs::remove_file(&tmp);
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    f.write_all(text.as_bytes())
        .and_then(|_| f.sync_all())
        .with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(server: Servers) -> Context {
        Context {
            server,
            ca_fingerprint: "sha256:00".into(),
            ca_pem: "PEM".into(),
            token: None,
        }
    }

    #[test]
    fn one_server_is_written_as_before_and_several_as_a_list() {
        let one = toml::to_string(&config(Servers(vec!["https://a:7443".into()]))).unwrap();
        assert!(one.contains("server = \"https://a:7443\""), "{one}");
        let two = Servers(vec!["https://a:7443".into(), "https://b:7443".into()]);
        let text = toml::to_string(&config(two.clone())).unwrap();
        assert!(
            text.contains("server = [\"https://a:7443\", \"https://b:7443\"]"),
            "{text}"
        );
        let back: Context = toml::from_str(&text).unwrap();
        assert_eq!(back.server, two);
        let old: Context = toml::from_str(&one).unwrap();
        assert_eq!(old.server.urls(), &vec!["https://a:7443".to_string()]);
        assert!(
            toml::from_str::<Context>(&text.replace("[\"https://a:7443\", \"https://b:7443\"]", "[]"))
                .is_err()
        );
    }

    fn file(contexts: &[(&str, &str)], current: Option<&str>) -> Config {
        Config {
            current_context: current.map(str::to_string),
            contexts: contexts
                .iter()
                .map(|(name, url)| (name.to_string(), config(Servers(vec![url.to_string()]))))
                .collect(),
        }
    }

    #[test]
    fn a_single_login_file_reads_as_the_current_default_context() {
        let old = "server = \"https://a:7443\"\nca_fingerprint = \"sha256:00\"\nca_pem = \"PEM\"\ntoken = \"otx_1\"\n";
        let read = parse(old).unwrap();
        assert_eq!(read.current_context.as_deref(), Some(MIGRATED));
        let (name, context) = read.select(None, Path::new("c")).unwrap();
        assert_eq!(name, MIGRATED);
        assert_eq!(context.token.as_deref(), Some("otx_1"));
        // Written back, it is in the new format and reads the same.
        let again = parse(&toml::to_string(&read).unwrap()).unwrap();
        assert_eq!(again.contexts, read.contexts);
        assert!(parse("server = \"https://a:7443\"\nbogus = 1\n").is_err());
        assert!(parse("current_context = \"a\"\nbogus = 1\n").is_err());
    }

    #[test]
    fn the_explicit_context_wins_over_the_current_and_unknown_names_are_refused() {
        let f = file(&[("a", "https://a:7443"), ("b", "https://b:7443")], Some("a"));
        let path = Path::new("/c.toml");
        assert_eq!(f.select(None, path).unwrap().0, "a");
        assert_eq!(f.select(Some("b"), path).unwrap().0, "b");
        let err = format!("{:#}", f.select(Some("c"), path).unwrap_err());
        assert_eq!(
            err,
            "no context \"c\" in /c.toml\nhint: the contexts are a, b (`otherix context list`)"
        );
        let none = file(&[("a", "https://a:7443")], None);
        let err = format!("{:#}", none.select(None, path).unwrap_err());
        assert!(err.starts_with("no current context in /c.toml\nhint: "), "{err}");
        let err = format!("{:#}", Config::default().select(None, path).unwrap_err());
        assert!(
            err.starts_with("not logged in: no context in /c.toml\nhint: "),
            "{err}"
        );
    }

    #[test]
    fn logging_in_again_to_the_same_servers_updates_their_context() {
        let f = file(
            &[("prod", "https://cp:7443"), ("x", "https://cp:7443")],
            Some("x"),
        );
        assert_eq!(
            f.name_for(&["https://cp:7443".into()]),
            "x",
            "the current one first"
        );
        let f = file(&[("prod", "https://cp:7443")], None);
        assert_eq!(f.name_for(&["https://cp:7443".into()]), "prod");
        assert_eq!(
            f.name_for(&["https://other.example:7443".into()]),
            "other.example"
        );
    }

    #[test]
    fn names_come_from_the_host_with_an_unusual_port() {
        assert_eq!(
            name_from_url("https://cp.example.internal:7443"),
            "cp.example.internal"
        );
        assert_eq!(
            name_from_url("https://cp.example.internal"),
            "cp.example.internal"
        );
        assert_eq!(name_from_url("https://127.0.0.1:9000/"), "127.0.0.1:9000");
        assert_eq!(name_from_url("https://[::1]:7443"), "::1");
        assert_eq!(name_from_url(""), MIGRATED);
        for url in ["https://127.0.0.1:9000", "https://[fe80::1]:1", "https://a_b.c"] {
            assert!(parse_name(&name_from_url(url)).is_ok(), "{url}");
        }
        assert!(parse_name("prod eu").is_err());
        assert!(parse_name("").is_err());
        assert!(parse_name("admin@prod-eu:2").is_ok());
    }

    #[test]
    fn a_lent_context_is_given_back_as_it_was_and_the_previous_one_is_current_again() {
        // `dev` did not exist: it goes, and `prod` is current again.
        let mut f = file(&[("prod", "https://cp:7443")], Some("prod"));
        let lent = f.lend("dev");
        assert_eq!(lent.previous(), Some("prod"));
        f.contexts.insert(
            "dev".into(),
            config(Servers(vec!["https://10.0.0.2:7443".into()])),
        );
        f.current_context = Some("dev".into());
        f.give_back(lent);
        assert_eq!(f.current_context.as_deref(), Some("prod"));
        assert_eq!(f.contexts.keys().collect::<Vec<_>>(), ["prod"]);

        // A `dev` of the user's own comes back as it was; nothing was current.
        let mut f = file(&[("dev", "https://mine:7443")], None);
        let lent = f.lend("dev");
        f.contexts.insert(
            "dev".into(),
            config(Servers(vec!["https://10.0.0.2:7443".into()])),
        );
        f.current_context = Some("dev".into());
        f.give_back(lent);
        assert_eq!(f.current_context, None);
        assert_eq!(f.contexts["dev"].server.0, ["https://mine:7443"]);

        // A context chosen meanwhile stays current.
        let mut f = file(
            &[("prod", "https://cp:7443"), ("lab", "https://lab:7443")],
            Some("prod"),
        );
        let lent = f.lend("dev");
        f.current_context = Some("lab".into());
        f.give_back(lent);
        assert_eq!(f.current_context.as_deref(), Some("lab"));

        // The previous one deleted meanwhile: none is current.
        let mut f = file(&[("prod", "https://cp:7443")], Some("prod"));
        let lent = f.lend("dev");
        f.contexts.clear();
        f.current_context = Some("dev".into());
        f.give_back(lent);
        assert_eq!(f.current_context, None);
    }
}

/// A grant ready to hand to its holder (`otherix grant create --file`): the
/// control plane's URLs, its CA fingerprint and the grant token, so that
/// `otherix login --grant-file FILE` is the one command the holder runs.
/// A file holding only the token (what `grant create > FILE` writes) reads
/// as a token without the rest.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrantFile {
    pub server: Vec<String>,
    pub ca_fingerprint: String,
    pub token: String,
}

impl GrantFile {
    /// What a grant file says: the whole file, or only its token.
    pub fn parse(text: &str) -> anyhow::Result<Result<GrantFile, String>> {
        let bare = text.trim();
        if !bare.contains('\n') && !bare.contains('=') {
            return Ok(Err(bare.to_string()));
        }
        let file: GrantFile =
            toml::from_str(text).context("not a grant file (server, ca_fingerprint, token)")?;
        Ok(Ok(file))
    }

    /// The file's text: a comment saying how to use it, then the fields.
    pub fn to_text(&self) -> anyhow::Result<String> {
        Ok(format!(
            "# An Otherix grant. Use it with:\n#   otherix login --grant-file THIS_FILE\n# Keep it secret: the token lets its holder in until the grant ends.\n{}",
            toml::to_string(self)?
        ))
    }
}

#[cfg(test)]
mod grant_file_tests {
    use super::*;

    #[test]
    fn a_grant_file_is_the_whole_grant_or_just_its_token() {
        let file = GrantFile {
            server: vec!["https://10.0.0.1:7443".into(), "https://10.0.0.2:7443".into()],
            ca_fingerprint: "sha256:ab".into(),
            token: "otxg_1_2".into(),
        };
        let text = file.to_text().unwrap();
        assert!(text.starts_with("# An Otherix grant"), "{text}");
        assert_eq!(GrantFile::parse(&text).unwrap(), Ok(file));
        assert_eq!(
            GrantFile::parse("otxg_1_2\n").unwrap(),
            Err("otxg_1_2".to_string())
        );
        assert!(GrantFile::parse("server = 1\ntoken = 2").is_err());
    }
}
