//! PASETO `v4.public` framing: what the broker signs and the gateways
//! verify (PASETO spec, `docs/01-Protocol-Versions/Version4.md`, and
//! `docs/01-Protocol-Versions/Common.md` for PAE).
//!
//! Written here rather than taken from `pasetors`, so that the signer and
//! the verifier are ours to choose and nothing is done twice per credential.
//! The framing is small and fixed — a header, base64url without padding of
//! `message || signature`, an optional base64url footer, and the Ed25519
//! signature over the pre-authentication encoding (PAE) of header, message,
//! footer and implicit assertion — and it is held to the specification's own
//! test vectors (tests below), so tokens stay what any PASETO v4 library,
//! and every gateway already deployed, verifies.
//!
//! The signature itself comes from the caller ([`sign`] takes it as a
//! function; the credential signs with AWS-LC); verification is AWS-LC's.
//! Of the three Ed25519s measured (`credential::tests::cost_of_minting_and_verifying`),
//! it signs in about half the time of `ed25519-compact` and 40 % of
//! ring's, and verifies about a fifth faster than ring. Its check is
//! BoringSSL's, as ring's is: the `R` the signature carries must be exactly
//! the one recomputed, and an unreduced `S` is refused (tested below;
//! `ed25519-compact` accepted an `R` off by a point of small order). The
//! tests sign the specification's vectors with all three and check each
//! one's signatures with the others, so the framing is not held to one
//! library's word.
//!
//! Pure, and strict in what it parses: anything but canonical framing is
//! [`Error::Malformed`] before a signature is looked at.

use aws_lc_rs::signature::{UnparsedPublicKey, ED25519};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;

/// Version and purpose, with the dot that ends them.
pub const HEADER: &str = "v4.public.";

/// An Ed25519 signature's length.
pub const SIG_LEN: usize = 64;

/// Why a token could not be made or was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Not `v4.public` framing (the presenter's fault): what is wrong.
    #[error("not a v4.public token: {0}")]
    Malformed(&'static str),
    /// Well framed, but the signature does not verify under the key: forged,
    /// tampered, signed by another key, or over another footer or implicit
    /// assertion (the presenter's fault).
    #[error("signature is invalid")]
    BadSignature,
    /// The caller asked to sign an empty message, which PASETO does not
    /// allow and no verifier accepts (the caller's fault).
    #[error("nothing to sign: the message is empty")]
    EmptyMessage,
    /// The signer gave no signature (an internal failure of the library;
    /// nobody's input).
    #[error("the signer failed")]
    Signer,
}

/// Signs `message` into a `v4.public` token, with `footer` (sent, signed)
/// and `implicit` (signed, not sent: the verifier must supply the same);
/// `ed25519` signs the bytes it is given with the key (`None`: it failed,
/// [`Error::Signer`]). Ed25519 is deterministic, so the same inputs give the
/// same token.
pub fn sign(
    message: &[u8],
    footer: &[u8],
    implicit: &[u8],
    ed25519: impl FnOnce(&[u8]) -> Option<[u8; SIG_LEN]>,
) -> Result<String, Error> {
    if message.is_empty() {
        return Err(Error::EmptyMessage);
    }
    let signature = ed25519(&pae(&[HEADER.as_bytes(), message, footer, implicit])).ok_or(Error::Signer)?;
    let mut body = Vec::with_capacity(message.len() + SIG_LEN);
    body.extend_from_slice(message);
    body.extend_from_slice(&signature);
    let mut token =
        String::with_capacity(HEADER.len() + encoded_len(body.len()) + 1 + encoded_len(footer.len()));
    token.push_str(HEADER);
    URL_SAFE_NO_PAD.encode_string(&body, &mut token);
    // An empty footer is left out, dot and all (the spec's framing).
    if !footer.is_empty() {
        token.push('.');
        URL_SAFE_NO_PAD.encode_string(footer, &mut token);
    }
    Ok(token)
}

/// A token split into its parts, its signature not checked yet: only
/// [`Untrusted::footer`] may be read (to choose the key) before
/// [`Untrusted::verify`].
#[derive(Debug)]
pub struct Untrusted {
    message: Vec<u8>,
    signature: [u8; SIG_LEN],
    footer: Vec<u8>,
}

/// Splits `token` into message, signature and footer. Strict: the header,
/// then one or two non-empty parts of canonical unpadded base64url (no
/// stray bits in the last character), and a message of at least one byte.
pub fn parse(token: &str) -> Result<Untrusted, Error> {
    let rest = token
        .strip_prefix(HEADER)
        .ok_or(Error::Malformed("it does not start with v4.public."))?;
    let (body, footer) = match rest.split_once('.') {
        Some((body, footer)) => (body, Some(footer)),
        None => (rest, None),
    };
    let mut message = URL_SAFE_NO_PAD
        .decode(body)
        .map_err(|_| Error::Malformed("the body is not unpadded base64url"))?;
    if message.len() <= SIG_LEN {
        return Err(Error::Malformed(
            "the body is too short for a message and a signature",
        ));
    }
    let footer = match footer {
        // Signed exactly as an absent one, so refused: one token, one text.
        Some("") => return Err(Error::Malformed("the footer is empty")),
        Some(footer) => URL_SAFE_NO_PAD
            .decode(footer)
            .map_err(|_| Error::Malformed("the footer is not unpadded base64url"))?,
        None => Vec::new(),
    };
    let mut signature = [0u8; SIG_LEN];
    signature.copy_from_slice(&message[message.len() - SIG_LEN..]);
    message.truncate(message.len() - SIG_LEN);
    Ok(Untrusted {
        message,
        signature,
        footer,
    })
}

impl Untrusted {
    /// The footer, as sent: not yet authenticated.
    pub fn footer(&self) -> &[u8] {
        &self.footer
    }

    /// The message, once the signature verifies under `public_key` (a raw
    /// 32-byte Ed25519 key) with `implicit` as the implicit assertion.
    pub fn verify(self, public_key: &[u8], implicit: &[u8]) -> Result<Vec<u8>, Error> {
        // A raw 32-byte key only (AWS-LC would also take an X.509 one).
        if public_key.len() != 32 {
            return Err(Error::BadSignature);
        }
        UnparsedPublicKey::new(&ED25519, public_key)
            .verify(&self.signed(implicit), &self.signature)
            .map_err(|_| Error::BadSignature)?;
        Ok(self.message)
    }

    /// What the signature covers.
    fn signed(&self, implicit: &[u8]) -> Vec<u8> {
        pae(&[HEADER.as_bytes(), &self.message, &self.footer, implicit])
    }

    /// What another Ed25519 needs to check the signature: the bytes signed,
    /// the signature, and the message they would vouch for.
    #[cfg(test)]
    pub(crate) fn parts(&self, implicit: &[u8]) -> (Vec<u8>, &[u8; SIG_LEN], &[u8]) {
        (self.signed(implicit), &self.signature, &self.message)
    }
}

/// Pre-authentication encoding: the count of pieces, then each piece after
/// its length, each number as 64-bit little-endian with the top bit clear.
/// Unambiguous, so no piece's bytes can pass for another's.
fn pae(pieces: &[&[u8]]) -> Vec<u8> {
    let len = 8 + pieces.iter().map(|p| 8 + p.len()).sum::<usize>();
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&le64(pieces.len()));
    for piece in pieces {
        out.extend_from_slice(&le64(piece.len()));
        out.extend_from_slice(piece);
    }
    out
}

fn le64(n: usize) -> [u8; 8] {
    // usize is at most 64 bits on every target Rust supports; the top bit
    // is cleared as the spec asks (for languages without unsigned 64-bit).
    (n as u64 & (u64::MAX >> 1)).to_le_bytes()
}

/// Unpadded base64 length of `n` bytes.
fn encoded_len(n: usize) -> usize {
    n / 3 * 4 + [0, 2, 3][n % 3]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    // The official PASETO v4 test vectors, from the specification's
    // repository (paseto-standard/test-vectors, `v4.json`), as the pasetors
    // 0.7.8 crate ships them (`test_vectors/v4.json`): the `v4.public` ones
    // (4-S-*) and the ones that must fail (4-F-*). All use this key.
    const SEED: &str = "b4cbfb43df4ce210727d953e4a713307fa19bb7d9f85041438d9e11b942a3774";
    const PUBLIC_KEY: &str = "1eb9dbbbbc047c03fd70604e0071f0987e16b28b757225c11f00415d0e20b1a2";
    const PAYLOAD: &str = r#"{"data":"this is a signed message","exp":"2022-01-01T00:00:00+00:00"}"#;
    const KID_FOOTER: &str = r#"{"kid":"zVhMiPBP9fRf2snEcT7gFTioeA9COcNy9DfgL1W60haN"}"#;

    struct Vector {
        name: &'static str,
        token: &'static str,
        footer: &'static str,
        implicit: &'static str,
    }

    const VALID: [Vector; 3] = [
        Vector {
            name: "4-S-1",
            token: "v4.public.eyJkYXRhIjoidGhpcyBpcyBhIHNpZ25lZCBtZXNzYWdlIiwiZXhwIjoiMjAyMi0wMS0wMVQwMDowMDowMCswMDowMCJ9bg_XBBzds8lTZShVlwwKSgeKpLT3yukTw6JUz3W4h_ExsQV-P0V54zemZDcAxFaSeef1QlXEFtkqxT1ciiQEDA",
            footer: "",
            implicit: "",
        },
        Vector {
            name: "4-S-2",
            token: "v4.public.eyJkYXRhIjoidGhpcyBpcyBhIHNpZ25lZCBtZXNzYWdlIiwiZXhwIjoiMjAyMi0wMS0wMVQwMDowMDowMCswMDowMCJ9v3Jt8mx_TdM2ceTGoqwrh4yDFn0XsHvvV_D0DtwQxVrJEBMl0F2caAdgnpKlt4p7xBnx1HcO-SPo8FPp214HDw.eyJraWQiOiJ6VmhNaVBCUDlmUmYyc25FY1Q3Z0ZUaW9lQTlDT2NOeTlEZmdMMVc2MGhhTiJ9",
            footer: KID_FOOTER,
            implicit: "",
        },
        Vector {
            name: "4-S-3",
            token: "v4.public.eyJkYXRhIjoidGhpcyBpcyBhIHNpZ25lZCBtZXNzYWdlIiwiZXhwIjoiMjAyMi0wMS0wMVQwMDowMDowMCswMDowMCJ9NPWciuD3d0o5eXJXG5pJy-DiVEoyPYWs1YSTwWHNJq6DZD3je5gf-0M4JR9ipdUSJbIovzmBECeaWmaqcaP0DQ.eyJraWQiOiJ6VmhNaVBCUDlmUmYyc25FY1Q3Z0ZUaW9lQTlDT2NOeTlEZmdMMVc2MGhhTiJ9",
            footer: KID_FOOTER,
            implicit: r#"{"test-vector":"4-S-3"}"#,
        },
    ];

    /// 4-F-1..5: a `v4.local` token, a `v4.public` one whose signature does
    /// not match (4-F-2), a `v3.local` one, and two more `v4.local` (one
    /// padded), each with its implicit assertion.
    const MUST_FAIL: [(&str, &str, &str); 5] = [
        (
            "4-F-1",
            "v4.local.vngXfCISbnKgiP6VWGuOSlYrFYU300fy9ijW33rznDYgxHNPwWluAY2Bgb0z54CUs6aYYkIJ-bOOOmJHPuX_34Agt_IPlNdGDpRdGNnBz2MpWJvB3cttheEc1uyCEYltj7wBQQYX.YXJiaXRyYXJ5LXN0cmluZy10aGF0LWlzbid0LWpzb24",
            r#"{"test-vector":"4-F-1"}"#,
        ),
        (
            "4-F-2",
            "v4.public.eyJpbnZhbGlkIjoidGhpcyBzaG91bGQgbmV2ZXIgZGVjb2RlIn22Sp4gjCaUw0c7EH84ZSm_jN_Qr41MrgLNu5LIBCzUr1pn3Z-Wukg9h3ceplWigpoHaTLcwxj0NsI1vjTh67YB.eyJraWQiOiJ6VmhNaVBCUDlmUmYyc25FY1Q3Z0ZUaW9lQTlDT2NOeTlEZmdMMVc2MGhhTiJ9",
            r#"{"test-vector":"4-F-2"}"#,
        ),
        (
            "4-F-3",
            "v3.local.23e_2PiqpQBPvRFKzB0zHhjmxK3sKo2grFZRRLM-U7L0a8uHxuF9RlVz3Ic6WmdUUWTxCaYycwWV1yM8gKbZB2JhygDMKvHQ7eBf8GtF0r3K0Q_gF1PXOxcOgztak1eD1dPe9rLVMSgR0nHJXeIGYVuVrVoLWQ.YXJiaXRyYXJ5LXN0cmluZy10aGF0LWlzbid0LWpzb24",
            r#"{"test-vector":"4-F-3"}"#,
        ),
        (
            "4-F-4",
            "v4.local.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAQAr68PS4AXe7If_ZgesdkUMvSwscFlAl1pk5HC0e8kApeaqMfGo_7OpBnwJOAbY9V7WU6abu74MmcUE8YWAiaArVI8XJ5hOb_4v9RmDkneN0S92dx0OW4pgy7omxgf3S8c3LlQh",
            "",
        ),
        (
            "4-F-5",
            "v4.local.32VIErrEkmY4JVILovbmfPXKW9wT1OdQepjMTC_MOtjA4kiqw7_tcaOM5GNEcnTxl60WkwMsYXw6FSNb_UdJPXjpzm0KW9ojM5f4O2mRvE2IcweP-PRdoHjd5-RHCiExR1IK6t4x-RMNXtQNbz7FvFZ_G-lFpk5RG3EOrwDL6CgDqcerSQ==.eyJraWQiOiJ6VmhNaVBCUDlmUmYyc25FY1Q3Z0ZUaW9lQTlDT2NOeTlEZmdMMVc2MGhhTiJ9",
            "",
        ),
    ];

    fn seed() -> [u8; 32] {
        unhex(SEED).try_into().unwrap()
    }

    /// The vectors' key, signing with AWS-LC (as the credential does).
    fn aws_lc(message: &[u8]) -> Option<[u8; SIG_LEN]> {
        let pair = aws_lc_rs::signature::Ed25519KeyPair::from_seed_unchecked(&seed()).unwrap();
        pair.try_sign(message).ok()?.as_ref().try_into().ok()
    }

    /// The vectors' key, signing with `ed25519-compact`.
    fn compact(message: &[u8]) -> Option<[u8; SIG_LEN]> {
        let pair = ed25519_compact::KeyPair::from_seed(ed25519_compact::Seed::new(seed()));
        Some(*pair.sk.sign(message, None))
    }

    /// The vectors' key, signing with ring.
    fn ring(message: &[u8]) -> Option<[u8; SIG_LEN]> {
        let pair = ring::signature::Ed25519KeyPair::from_seed_unchecked(&seed()).unwrap();
        pair.sign(message).as_ref().try_into().ok()
    }

    fn check(token: &str, implicit: &str) -> Result<(Vec<u8>, Vec<u8>), Error> {
        let untrusted = parse(token)?;
        let footer = untrusted.footer().to_vec();
        Ok((untrusted.verify(&unhex(PUBLIC_KEY), implicit.as_bytes())?, footer))
    }

    #[test]
    fn the_seed_gives_the_vectors_public_key() {
        let pair = aws_lc_rs::signature::Ed25519KeyPair::from_seed_unchecked(&seed()).unwrap();
        assert_eq!(
            aws_lc_rs::signature::KeyPair::public_key(&pair).as_ref(),
            unhex(PUBLIC_KEY).as_slice()
        );
        let pair = ed25519_compact::KeyPair::from_seed(ed25519_compact::Seed::new(seed()));
        assert_eq!(pair.pk.as_slice(), unhex(PUBLIC_KEY).as_slice());
        let pair = ring::signature::Ed25519KeyPair::from_seed_unchecked(&seed()).unwrap();
        assert_eq!(
            ring::signature::KeyPair::public_key(&pair).as_ref(),
            unhex(PUBLIC_KEY).as_slice()
        );
    }

    #[test]
    fn signing_gives_exactly_the_spec_vectors_tokens_with_each_ed25519() {
        for v in &VALID {
            let (footer, implicit) = (v.footer.as_bytes(), v.implicit.as_bytes());
            let token = sign(PAYLOAD.as_bytes(), footer, implicit, aws_lc).unwrap();
            assert_eq!(token, v.token, "{}", v.name);
            let token = sign(PAYLOAD.as_bytes(), footer, implicit, compact).unwrap();
            assert_eq!(token, v.token, "{} (ed25519-compact)", v.name);
            let token = sign(PAYLOAD.as_bytes(), footer, implicit, ring).unwrap();
            assert_eq!(token, v.token, "{} (ring)", v.name);
        }
    }

    /// Many messages, not the vectors' one: what AWS-LC signs, ring and
    /// `ed25519-compact` verify, and its signature is theirs byte for byte.
    #[test]
    fn the_other_ed25519s_agree_with_aws_lcs_signatures() {
        let public = ring::signature::UnparsedPublicKey::new(&ring::signature::ED25519, unhex(PUBLIC_KEY));
        let compact_public = ed25519_compact::PublicKey::from_slice(&unhex(PUBLIC_KEY)).unwrap();
        for n in 1..=300usize {
            let message: Vec<u8> = (0..n).map(|i| (i * 7 + n) as u8).collect();
            let signature = aws_lc(&message).unwrap();
            assert_eq!(Some(signature), ring(&message), "{n}");
            assert_eq!(Some(signature), compact(&message), "{n}");
            public.verify(&message, &signature).unwrap();
            compact_public
                .verify(&message, &ed25519_compact::Signature::new(signature))
                .unwrap();
        }
    }

    /// `S + L` passes the verification equation as `S` does (the group's
    /// order is `L`): a second signature for one message, unless `S` must be
    /// reduced. RFC 8032 §5.1.7 says it must; so does the verifier here.
    #[test]
    fn a_signature_with_s_unreduced_is_refused() {
        // L = 2^252 + 27742317777372353535851937790883648493, little-endian.
        const L: [u8; 32] = [
            0xed, 0xd3, 0xf5, 0x5c, 0x1a, 0x63, 0x12, 0x58, 0xd6, 0x9c, 0xf7, 0xa2, 0xde, 0xf9, 0xde, 0x14,
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10,
        ];
        let token = VALID[0].token;
        let mut raw = URL_SAFE_NO_PAD.decode(&token[HEADER.len()..]).unwrap();
        let s = raw.len() - 32;
        let mut carry = 0u16;
        for (byte, l) in raw[s..].iter_mut().zip(L) {
            let sum = u16::from(*byte) + u16::from(l) + carry;
            *byte = sum as u8;
            carry = sum >> 8;
        }
        assert_eq!(carry, 0, "S + L fits in 32 bytes");
        let unreduced = format!("{HEADER}{}", URL_SAFE_NO_PAD.encode(&raw));
        assert_eq!(check(&unreduced, ""), Err(Error::BadSignature));
        // The honest token still verifies, so it is the S that is refused.
        assert!(check(token, "").is_ok());
    }

    #[test]
    fn a_signer_that_fails_gives_no_token() {
        assert_eq!(sign(b"m", b"", b"", |_| None), Err(Error::Signer));
    }

    #[test]
    fn the_spec_vectors_tokens_verify_to_their_payload_and_footer() {
        for v in &VALID {
            let (message, footer) = check(v.token, v.implicit).unwrap_or_else(|e| panic!("{}: {e}", v.name));
            assert_eq!(message, PAYLOAD.as_bytes(), "{}", v.name);
            assert_eq!(footer, v.footer.as_bytes(), "{}", v.name);
        }
    }

    #[test]
    fn the_spec_vectors_that_must_fail_are_refused() {
        for (name, token, implicit) in MUST_FAIL {
            let refusal = check(token, implicit).unwrap_err();
            let expected = if name == "4-F-2" {
                Error::BadSignature
            } else {
                Error::Malformed("it does not start with v4.public.")
            };
            assert_eq!(refusal, expected, "{name}");
        }
    }

    #[test]
    fn another_implicit_assertion_footer_or_key_breaks_the_signature() {
        let [s1, s2, s3] = &VALID;
        // 4-S-3 verified without its implicit assertion, or with another.
        assert_eq!(check(s3.token, ""), Err(Error::BadSignature));
        assert_eq!(
            check(s3.token, r#"{"test-vector":"4-S-2"}"#),
            Err(Error::BadSignature)
        );
        assert_eq!(check(s1.token, "x"), Err(Error::BadSignature));
        // 4-S-2's body with 4-S-1's (absent) footer, and the reverse.
        let body2 = s2.token.split('.').nth(2).unwrap();
        assert_eq!(check(&format!("{HEADER}{body2}"), ""), Err(Error::BadSignature));
        let footer2 = s2.token.rsplit('.').next().unwrap();
        assert_eq!(
            check(&format!("{}.{footer2}", s1.token), ""),
            Err(Error::BadSignature)
        );
        // Another key.
        let other = ed25519_compact::KeyPair::from_seed(ed25519_compact::Seed::new([9; 32]));
        let token = sign(PAYLOAD.as_bytes(), b"", b"", |m| Some(*other.sk.sign(m, None))).unwrap();
        assert_eq!(check(&token, ""), Err(Error::BadSignature));
    }

    #[test]
    fn every_flipped_byte_of_a_token_is_refused() {
        let token = VALID[1].token;
        for i in HEADER.len()..token.len() {
            let mut bytes = token.as_bytes().to_vec();
            bytes[i] = if bytes[i] == b'A' { b'B' } else { b'A' };
            let Ok(flipped) = String::from_utf8(bytes) else {
                continue;
            };
            assert!(check(&flipped, "").is_err(), "byte {i}");
        }
    }

    #[test]
    fn framing_is_parsed_strictly() {
        let s1 = VALID[0].token;
        let s2 = VALID[1].token;
        for (bad, why) in [
            ("", "it does not start with v4.public."),
            ("v4.public", "it does not start with v4.public."),
            ("V4.PUBLIC.eyJ9", "it does not start with v4.public."),
            (
                "v4.public.",
                "the body is too short for a message and a signature",
            ),
            (
                "v4.public.AAAA",
                "the body is too short for a message and a signature",
            ),
            (
                "v4.public..eyJ9",
                "the body is too short for a message and a signature",
            ),
            ("v4.public.!!!!", "the body is not unpadded base64url"),
        ] {
            assert_eq!(parse(bad).unwrap_err(), Error::Malformed(why), "{bad:?}");
        }
        // Padding, the standard alphabet, a length no bytes encode to, a
        // third part, an empty footer: not the canonical text of any token.
        let padded = format!("{s1}==");
        let standard = s1.replace('_', "/");
        let stray = format!("{s1}AAA");
        let third = format!("{s2}.eyJ9");
        let empty_footer = format!("{s1}.");
        for bad in [&padded, &standard, &stray, &third, &empty_footer] {
            assert!(matches!(parse(bad), Err(Error::Malformed(_))), "{bad}");
        }
        // 4-S-1's body is 69 + 64 bytes, one past a multiple of three: its
        // last character carries 4 spare bits. Set, they would decode to the
        // same bytes (a second text for one token), so they are refused.
        assert_eq!(s1.chars().last(), Some('A'));
        let spare = format!("{}B", &s1[..s1.len() - 1]);
        assert!(matches!(parse(&spare), Err(Error::Malformed(_))));
    }

    #[test]
    fn an_empty_message_is_not_signed() {
        assert_eq!(sign(b"", b"f", b"", compact), Err(Error::EmptyMessage));
    }

    #[test]
    fn pae_matches_the_specs_examples() {
        // Common.md, "PAE Definition".
        assert_eq!(pae(&[]), unhex("0000000000000000"));
        assert_eq!(pae(&[b""]), unhex("01000000000000000000000000000000"));
        assert_eq!(pae(&[b"test"]), unhex("0100000000000000040000000000000074657374"));
        assert_eq!(le64(usize::MAX), [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]);
    }

    #[test]
    fn encoded_len_is_base64_without_padding() {
        for n in 0..200 {
            assert_eq!(encoded_len(n), URL_SAFE_NO_PAD.encode(vec![0u8; n]).len(), "{n}");
        }
    }
}
