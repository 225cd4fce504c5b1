//! Fuzzes the label selector parser and the label key, value and edit
//! parsers: the text users type (`--selector`, `--label`, `vm label`) and
//! the API carries in LB, access-rule and VM bodies. Never a panic; an
//! error points inside the input; an accepted selector prints in a
//! canonical form that parses back to itself, also through JSON (how it is
//! stored), and matching it against any labels is total; whatever a label
//! parser accepts passes validation.
#![no_main]

use libfuzzer_sys::fuzz_target;
use otherix_core::labels::{
    parse_label, parse_label_change, validate_label_key, validate_label_value, validate_labels, LabelChange,
    Labels,
};
use otherix_core::selector::Selector;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // Selectors.
    match text.parse::<Selector>() {
        Ok(selector) => {
            let canonical = selector.to_string();
            let again: Selector = canonical.parse().expect("the canonical form parses");
            assert_eq!(again, selector, "{canonical:?} does not parse back to {text:?}'s selector");
            assert_eq!(again.to_string(), canonical, "the canonical form is a fixed point");
            let stored = serde_json::to_string(&selector).expect("a selector serializes");
            let loaded: Selector = serde_json::from_str(&stored).expect("a stored selector loads");
            assert_eq!(loaded, selector);
            for requirement in selector.requirements() {
                assert!(validate_label_key(requirement.key()).is_ok());
            }
            // Labels made of the input's own pieces, so matches are reachable.
            let labels = labels_from(text);
            let all = selector.matches(&labels);
            assert_eq!(all, selector.requirements().iter().all(|r| r.matches(&labels)));
            assert!(selector.is_empty() == selector.requirements().is_empty());
            assert!(!selector.is_empty() || all, "the empty selector matches everything");
        }
        Err(e) => {
            assert!(e.position <= text.chars().count(), "{e}");
            let _ = e.to_string();
        }
    }
    // JSON: selectors deserialize from a string (`try_from = "String"`).
    if let Ok(selector) = serde_json::from_slice::<Selector>(data) {
        assert_eq!(selector.to_string().parse::<Selector>().as_ref(), Ok(&selector));
    }
    // Labels and edits.
    if let Ok((key, value)) = parse_label(text) {
        assert!(validate_label_key(&key).is_ok() && validate_label_value(&value).is_ok());
        assert_eq!(format!("{key}={value}"), text);
    }
    match parse_label_change(text) {
        Ok(change) => {
            let mut labels = labels_from(text);
            change.apply(&mut labels);
            match change {
                LabelChange::Set(key, value) => assert_eq!(labels.get(&key), Some(&value)),
                LabelChange::Remove(key) => {
                    assert!(validate_label_key(&key).is_ok());
                    assert!(!labels.contains_key(&key));
                }
            }
        }
        Err(e) => {
            let _ = (e.position(), e.to_string());
        }
    }
    for result in [validate_label_key(text), validate_label_value(text)] {
        if let Err(e) = result {
            if let Some(position) = e.position() {
                assert!(position <= text.chars().count(), "{e}");
            }
        }
    }
});

/// `k=v` pairs split out of the input at `,`, spaces and parentheses,
/// keeping only valid labels.
fn labels_from(text: &str) -> Labels {
    let labels: Labels = text
        .split([',', ' ', '(', ')'])
        .filter_map(|part| parse_label(part).ok())
        .collect();
    assert!(validate_labels(&labels).is_ok());
    labels
}
