//! The client configuration file: which control plane, which token, which CA
//! to trust. Lives at `$XDG_CONFIG_HOME/otherix/config.toml` (or
//! `~/.config/...`); `OTHERIX_CONFIG` / `--config` point elsewhere.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context};
use serde::{Deserialize, Serialize};

use crate::env;

#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientConfig {
    /// Control plane URL, or the URLs of its replicas (a list).
    pub server: Servers,
    /// `sha256:...` of the pinned cluster CA (for people; `ca_pem` is what is trusted).
    pub ca_fingerprint: String,
    /// The pinned cluster CA certificate.
    pub ca_pem: String,
    /// API token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

impl std::fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConfig")
            .field("server", &self.server)
            .field("ca_fingerprint", &self.ca_fingerprint)
            .finish_non_exhaustive()
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

pub fn load(path: &Path) -> anyhow::Result<ClientConfig> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(anyhow!(
                "not logged in: no client config at {}\nhint: run `otherix login --server URL --token-file FILE --ca-fingerprint sha256:...`",
                path.display()
            ))
        }
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    toml::from_str(&text).with_context(|| format!("invalid client config {}", path.display()))
}

/// Writes the config atomically, readable by its owner only (it holds a token).
pub fn save(path: &Path, config: &ClientConfig) -> anyhow::Result<()> {
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

    fn config(server: Servers) -> ClientConfig {
        ClientConfig {
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
        let back: ClientConfig = toml::from_str(&text).unwrap();
        assert_eq!(back.server, two);
        let old: ClientConfig = toml::from_str(&one).unwrap();
        assert_eq!(old.server.urls(), &vec!["https://a:7443".to_string()]);
        assert!(toml::from_str::<ClientConfig>(
            &text.replace("[\"https://a:7443\", \"https://b:7443\"]", "[]")
        )
        .is_err());
    }
}
