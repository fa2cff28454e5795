//! The strategies this build knows, in the order the report and dashboard show them,
//! looked up by name.

use std::sync::Arc;

use super::Strategy;

#[derive(Clone)]
pub struct Registry {
    strategies: Arc<[Arc<dyn Strategy>]>,
}

/// A name no strategy of this build answers to.
#[derive(Debug, thiserror::Error)]
#[error("unknown strategy '{name}'; known: {known}")]
pub struct UnknownStrategy {
    pub name: String,
    pub known: String,
}

impl Registry {
    pub fn new(strategies: Vec<Arc<dyn Strategy>>) -> Registry {
        Registry {
            strategies: strategies.into(),
        }
    }

    pub fn all(&self) -> &[Arc<dyn Strategy>] {
        &self.strategies
    }

    pub fn names(&self) -> Vec<&'static str> {
        self.strategies.iter().map(|s| s.name()).collect()
    }

    pub fn named(&self, name: &str) -> Result<Arc<dyn Strategy>, UnknownStrategy> {
        self.strategies
            .iter()
            .find(|s| s.name() == name)
            .cloned()
            .ok_or_else(|| UnknownStrategy {
                name: name.to_owned(),
                known: self.names().join(", "),
            })
    }
}
