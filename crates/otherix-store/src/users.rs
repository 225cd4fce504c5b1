//! Users, their API tokens (hashes only) and their access rules.

use otherix_proto::{AccessRule, Role, TokenInfo, User};
use sqlx::Row;
use time::OffsetDateTime;

use crate::error::is_unique_violation;
use crate::revocations::{self, Revoking};
use crate::{from_millis, to_millis, Store, StoreError};

/// What authentication needs to know about a token.
#[derive(Clone)]
pub struct TokenRecord {
    pub id: String,
    pub user: String,
    pub role: Role,
    pub secret_hash: Vec<u8>,
    pub last_used_at: Option<OffsetDateTime>,
    /// When it stops working (`None`: never).
    pub expires_at: Option<OffsetDateTime>,
}

impl std::fmt::Debug for TokenRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenRecord")
            .field("id", &self.id)
            .field("user", &self.user)
            .field("role", &self.role)
            .finish_non_exhaustive()
    }
}

pub(crate) fn token_from_row(r: &sqlx::any::AnyRow) -> Result<TokenRecord, StoreError> {
    Ok(TokenRecord {
        id: r.get("id"),
        user: r.get("user_name"),
        role: parse_role(r.get("role"))?,
        secret_hash: r.get("secret_hash"),
        last_used_at: r.get::<Option<i64>, _>("last_used_at").map(from_millis),
        expires_at: r.get::<Option<i64>, _>("expires_at").map(from_millis),
    })
}

fn parse_role(s: &str) -> Result<Role, StoreError> {
    Ok(s.parse()?)
}

impl Store {
    /// Creates the first admin and its token, only if there are no users yet.
    /// Returns whether it did.
    pub async fn bootstrap_admin(
        &self,
        name: &str,
        token_id: &str,
        secret_hash: &[u8],
        now: OffsetDateTime,
    ) -> Result<bool, StoreError> {
        let mut tx = self.begin_write().await?;
        let users: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM users")
            .fetch_one(&mut *tx)
            .await?;
        if users > 0 {
            return Ok(false);
        }
        sqlx::query("INSERT INTO users (name, role, created_at) VALUES ($1, 'admin', $2)")
            .bind(name)
            .bind(to_millis(now))
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO api_tokens (id, user_name, secret_hash, created_at) VALUES ($1, $2, $3, $4)",
        )
        .bind(token_id)
        .bind(name)
        .bind(secret_hash)
        .bind(to_millis(now))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    pub async fn create_user(&self, name: &str, role: Role, now: OffsetDateTime) -> Result<User, StoreError> {
        let res = self
            .exec(
                sqlx::query("INSERT INTO users (name, role, created_at) VALUES ($1, $2, $3)")
                    .bind(name)
                    .bind(role.as_str())
                    .bind(to_millis(now)),
            )
            .await;
        match res {
            Err(e) if is_unique_violation(&e) => Err(StoreError::AlreadyExists {
                kind: "user",
                name: name.into(),
            }),
            Err(e) => Err(e),
            Ok(_) => self.user(name).await,
        }
    }

    pub async fn users(&self) -> Result<Vec<User>, StoreError> {
        let names: Vec<String> = sqlx::query_scalar("SELECT name FROM users ORDER BY name")
            .fetch_all(&self.read)
            .await?;
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            out.push(self.user(&name).await?);
        }
        Ok(out)
    }

    pub async fn user(&self, name: &str) -> Result<User, StoreError> {
        let row = sqlx::query("SELECT name, role, created_at FROM users WHERE name = $1")
            .bind(name)
            .fetch_optional(&self.read)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                kind: "user",
                name: name.into(),
            })?;
        let rules = self.rules(name).await?;
        let tokens = sqlx::query(
            "SELECT id, created_at, last_used_at, expires_at FROM api_tokens WHERE user_name = $1 ORDER BY created_at, id",
        )
        .bind(name)
        .fetch_all(&self.read)
        .await?
        .into_iter()
        .map(|r| TokenInfo {
            id: r.get("id"),
            created_at: from_millis(r.get("created_at")),
            last_used_at: r.get::<Option<i64>, _>("last_used_at").map(from_millis),
            expires_at: r.get::<Option<i64>, _>("expires_at").map(from_millis),
        })
        .collect();
        Ok(User {
            name: row.get("name"),
            role: parse_role(row.get("role"))?,
            created_at: from_millis(row.get("created_at")),
            rules,
            tokens,
        })
    }

    /// Deletes a user with its tokens and rules. The last admin cannot go:
    /// nobody could manage the cluster afterwards.
    /// Deletes the user (with its tokens and rules) and records `revoking`.
    pub async fn delete_user(&self, name: &str, revoking: Revoking<'_>) -> Result<(), StoreError> {
        let mut tx = self.begin_write().await?;
        let role: Option<String> = sqlx::query_scalar("SELECT role FROM users WHERE name = $1")
            .bind(name)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(role) = role else {
            return Err(StoreError::NotFound {
                kind: "user",
                name: name.into(),
            });
        };
        if role == "admin" {
            let admins: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM users WHERE role = 'admin'")
                .fetch_one(&mut *tx)
                .await?;
            if admins <= 1 {
                return Err(StoreError::Conflict(format!(
                    "user {name:?} is the last admin and cannot be deleted"
                )));
            }
        }
        sqlx::query("DELETE FROM users WHERE name = $1")
            .bind(name)
            .execute(&mut *tx)
            .await?;
        revocations::insert(&mut tx, revoking).await?;
        tx.commit().await?;
        Ok(())
    }

    /// A token for `user`, working until `expires_at` (`None`: never).
    pub async fn create_token(
        &self,
        user: &str,
        id: &str,
        secret_hash: &[u8],
        now: OffsetDateTime,
        expires_at: Option<OffsetDateTime>,
    ) -> Result<(), StoreError> {
        let res = self
            .exec(
                sqlx::query(
                    "INSERT INTO api_tokens (id, user_name, secret_hash, created_at, expires_at)
             SELECT $1, name, $2, $3, $4 FROM users WHERE name = $5",
                )
                .bind(id)
                .bind(secret_hash)
                .bind(to_millis(now))
                .bind(expires_at.map(to_millis))
                .bind(user),
            )
            .await?;
        if res.rows_affected() == 0 {
            return Err(StoreError::NotFound {
                kind: "user",
                name: user.into(),
            });
        }
        Ok(())
    }

    /// Looks a token up by its public id.
    pub async fn token(&self, id: &str) -> Result<Option<TokenRecord>, StoreError> {
        let row = sqlx::query(
            "SELECT t.id, t.user_name, u.role, t.secret_hash, t.last_used_at, t.expires_at
             FROM api_tokens t JOIN users u ON u.name = t.user_name WHERE t.id = $1",
        )
        .bind(id)
        .fetch_optional(&self.read)
        .await?;
        row.as_ref().map(token_from_row).transpose()
    }

    pub async fn touch_token(&self, id: &str, now: OffsetDateTime) -> Result<(), StoreError> {
        self.exec(
            sqlx::query("UPDATE api_tokens SET last_used_at = $1 WHERE id = $2")
                .bind(to_millis(now))
                .bind(id),
        )
        .await?;
        Ok(())
    }

    /// Deletes the token and records `revoking`.
    pub async fn revoke_token(&self, user: &str, id: &str, revoking: Revoking<'_>) -> Result<(), StoreError> {
        let mut tx = self.begin_write().await?;
        let res = sqlx::query("DELETE FROM api_tokens WHERE id = $1 AND user_name = $2")
            .bind(id)
            .bind(user)
            .execute(&mut *tx)
            .await?;
        if res.rows_affected() == 0 {
            return Err(StoreError::NotFound {
                kind: "token",
                name: id.into(),
            });
        }
        revocations::insert(&mut tx, revoking).await?;
        tx.commit().await?;
        Ok(())
    }

    pub async fn rules(&self, user: &str) -> Result<Vec<AccessRule>, StoreError> {
        let rows =
            sqlx::query("SELECT id, selector, ports FROM access_rules WHERE user_name = $1 ORDER BY id")
                .bind(user)
                .fetch_all(&self.read)
                .await?;
        rows.into_iter()
            .map(|r| {
                let ports: String = r.get("ports");
                Ok(AccessRule {
                    id: r.get("id"),
                    selector: r.get("selector"),
                    ports: serde_json::from_str(&ports).map_err(|e| StoreError::Corrupt(e.to_string()))?,
                    // The control plane's policy says; the store keeps the text.
                    inert: None,
                })
            })
            .collect()
    }

    pub async fn add_rule(
        &self,
        user: &str,
        selector: &str,
        ports: &[u16],
        now: OffsetDateTime,
    ) -> Result<User, StoreError> {
        let ports = serde_json::to_string(ports).map_err(|e| StoreError::Invalid(e.to_string()))?;
        let res = self
            .exec(
                sqlx::query(
                    "INSERT INTO access_rules (user_name, selector, ports, created_at)
             SELECT name, $1, $2, $3 FROM users WHERE name = $4",
                )
                .bind(selector)
                .bind(ports)
                .bind(to_millis(now))
                .bind(user),
            )
            .await?;
        if res.rows_affected() == 0 {
            return Err(StoreError::NotFound {
                kind: "user",
                name: user.into(),
            });
        }
        self.user(user).await
    }

    /// Removes the rule and records `revoking`.
    pub async fn remove_rule(&self, user: &str, id: i64, revoking: Revoking<'_>) -> Result<(), StoreError> {
        let mut tx = self.begin_write().await?;
        let res = sqlx::query("DELETE FROM access_rules WHERE id = $1 AND user_name = $2")
            .bind(id)
            .bind(user)
            .execute(&mut *tx)
            .await?;
        if res.rows_affected() == 0 {
            return Err(StoreError::NotFound {
                kind: "rule",
                name: id.to_string(),
            });
        }
        revocations::insert(&mut tx, revoking).await?;
        tx.commit().await?;
        Ok(())
    }
}
