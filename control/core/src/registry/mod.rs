//! The replicated registry: classes (each names its lane), models, tenants, and the replicas the
//! agents report as routable. Everything here is applied through Raft, so every controller's
//! router sees the same registry; a model registered under an existing class is servable as soon
//! as the entry is applied, with no router change or restart.
//!
//! Units are integers in the replicated state (the state is compared and hashed byte for byte):
//! times in microseconds behind [`Millis`], which reads and writes as fractional milliseconds.

pub mod access;
pub mod class;
pub mod model;
pub mod presets;
pub mod replicas;
pub mod rollout;
pub mod tenant;

pub use access::*;
pub use class::*;
pub use model::*;
pub use replicas::*;
pub use tenant::*;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::refused::Refused;
use rollout::{Rollout, RolloutAction, RolloutState};

/// Longest class, model or tenant name.
pub const MAX_NAME: usize = 63;
/// Most models, classes or tenants of each kind.
pub const MAX_ENTRIES: usize = 10_000;

/// The registry part of the replicated state: classes, models and tenants, and by area what
/// placement, capacity and access keep. The areas are flattened, so the snapshot's JSON is one
/// object as it was before they were split out (the golden test holds it byte for byte).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registry {
    pub classes: BTreeMap<String, Class>,
    pub models: BTreeMap<String, Model>,
    pub tenants: BTreeMap<String, Tenant>,
    /// Where replicas run: placed (intent) and reported (observed), pools' taints, MIG layouts.
    #[serde(flatten)]
    pub placement: Placement,
    /// What the slow loop and the MIG planner asked for.
    #[serde(flatten)]
    pub capacity: crate::capacity::CapacityState,
    /// Who may join and call: join tokens, admin tokens, revoked certificates.
    #[serde(flatten)]
    pub access: Access,
    /// Public model name → the entry serving it, once a rollout promoted a later version
    /// (absent: the entry of the same name).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub serving: BTreeMap<String, String>,
    /// Public model name → its latest rollout (kept when it ends, for `lanectl rollout status`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rollouts: BTreeMap<String, Rollout>,
}

#[cfg(any(test, feature = "test-util"))]
impl Registry {
    /// Deploys version `version` of the registered `model` (same specification) and starts a
    /// shadow rollout of it copying every request.
    pub fn start_shadow_for_test(&mut self, model: &str, version: &str) {
        let next = Model {
            version: version.into(),
            ..self.models[model].clone()
        };
        self.deploy_version(&next).unwrap();
        let r = rollout::RolloutRequest {
            model: model.into(),
            version: version.into(),
            strategy: rollout::Strategy::Shadow,
            steps: vec![100],
            bake_s: 60,
            guards: Default::default(),
        }
        .rollout(self, 0, "admin:test")
        .unwrap();
        self.start_rollout(&r).unwrap();
    }
}

/// Checks a class, model or tenant name.
pub fn validate_name(what: &str, name: &str) -> Result<(), Refused> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_' || c == '.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric());
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what} name {name:?}: use 1-{MAX_NAME} characters of a-z, 0-9, '-', '_' and '.', starting with a letter or digit"
        ).into())
    }
}

impl Registry {
    /// The entry of version `version` of the model clients call `name`.
    pub fn version_entry(&self, name: &str, version: &str) -> Option<&Model> {
        self.models
            .values()
            .find(|m| m.public_name() == name && m.version == version)
    }

    pub fn put_class(&mut self, class: &Class) -> Result<(), Refused> {
        class.validate()?;
        if let Some(old) = self.classes.get(&class.name) {
            if old.lane != class.lane {
                let models: Vec<&str> = self
                    .models
                    .values()
                    .filter(|m| m.class == class.name)
                    .map(|m| m.name.as_str())
                    .collect();
                if !models.is_empty() {
                    return Err(Refused::Conflict(format!(
                        "class {} is a {} lane with models ({}); its lane kind cannot change under them: create a new class and move the models",
                        class.name,
                        old.lane,
                        models.join(", ")
                    )));
                }
            }
        } else if self.classes.len() >= MAX_ENTRIES {
            return Err(Refused::Conflict(format!(
                "{MAX_ENTRIES} classes already; remove one first"
            )));
        }
        self.classes.insert(class.name.clone(), class.clone());
        Ok(())
    }

    pub fn put_model(&mut self, model: &Model) -> Result<(), Refused> {
        model.validate()?;
        self.check_fallback(model)?;
        if model.serves.is_some() {
            return Err(format!(
                "model {}: `serves` is set by the registry, not in a model file; remove it",
                model.name
            )
            .into());
        }
        if let Some(r) = self
            .rollouts
            .values()
            .find(|r| r.state.is_active() && (r.from == model.name || r.to == model.name))
        {
            return Err(Refused::Conflict(format!(
                "model {} is in the running rollout of {} (version {} → {}): a rollout compares fixed versions; promote or abort it first, or deploy a new version",
                model.name, r.model, r.from_version, r.to_version
            )));
        }
        if !self.classes.contains_key(&model.class) {
            return Err(Refused::NotFound(format!(
                "model {}: class {:?} does not exist; `lanectl lane list` shows the classes",
                model.name, model.class
            )));
        }
        if !self.models.contains_key(&model.name) && self.models.len() >= MAX_ENTRIES {
            return Err(Refused::Conflict(format!(
                "{MAX_ENTRIES} models already; remove one first"
            )));
        }
        self.models.insert(model.name.clone(), model.clone());
        Ok(())
    }

    /// A model's fallback names another existing model, not in a durable class.
    fn check_fallback(&self, model: &Model) -> Result<(), Refused> {
        let Some(f) = &model.fallback else { return Ok(()) };
        if f == model.public_name() {
            return Err(format!("model {}: a model cannot be its own fallback", model.name).into());
        }
        let Some(fm) = self.models.get(self.serving_entry(f)) else {
            return Err(Refused::NotFound(format!(
                "model {}: fallback {f:?} is not registered; register it first (`lanectl model list` shows the models)",
                model.name
            )));
        };
        if self.classes.get(&fm.class).is_some_and(|c| c.lane == LaneKind::Durable) {
            return Err(format!(
                "model {}: fallback {f} is in a durable class; a fallback answers synchronously",
                model.name
            )
            .into());
        }
        Ok(())
    }

    /// The entry that serves the public model `name` (stable traffic).
    pub fn serving_entry<'a>(&'a self, name: &'a str) -> &'a str {
        self.serving
            .get(name)
            .filter(|e| self.models.contains_key(e.as_str()))
            .map_or(name, String::as_str)
    }

    /// The rollout of `name` that is running or paused.
    pub fn active_rollout(&self, name: &str) -> Option<&Rollout> {
        self.rollouts.get(name).filter(|r| r.state.is_active())
    }

    /// What version entry `m` does now: `serving` its name, `in rollout` (the target of a
    /// running or paused rollout), or `idle` (a specification only).
    pub fn version_state(&self, m: &Model) -> &'static str {
        let public = m.public_name();
        if self.serving_entry(public) == m.name {
            "serving"
        } else if self.active_rollout(public).is_some_and(|r| r.to == m.name) {
            "in rollout"
        } else {
            "idle"
        }
    }

    /// Whether `m`'s replicas are placed: it serves its model, or a running rollout is moving
    /// traffic to it. Other versions are kept as specifications only, costing no GPU.
    pub fn is_placed(&self, m: &Model) -> bool {
        let public = m.public_name();
        self.serving_entry(public) == m.name || self.active_rollout(public).is_some_and(|r| r.to == m.name)
    }

    /// Deploys a version of a model (`lanectl model deploy`): the first version of a name is
    /// an ordinary model; a later one becomes the entry `name@version`, idle until a rollout
    /// moves traffic to it. Versions are immutable: deploying one again with another
    /// specification is refused. Returns the entry key.
    pub fn deploy_version(&mut self, model: &Model) -> Result<String, Refused> {
        if model.serves.is_some() {
            return Err(format!(
                "model {}: `serves` is set by the registry, not in a model file; remove it",
                model.name
            )
            .into());
        }
        validate_name("version", &model.version)?;
        let Some(current) = self.models.get(self.serving_entry(&model.name)) else {
            self.put_model(model)?;
            return Ok(model.name.clone());
        };
        if current.class != model.class {
            return Err(format!(
                "model {} is in class {}, this version says {}: a version changes the model, not its lane; keep class = {:?}",
                model.name, current.class, model.class, current.class
            ).into());
        }
        if let Some(e) = self.version_entry(&model.name, &model.version) {
            let same = Model {
                name: e.public_name().to_string(),
                serves: None,
                ..e.clone()
            } == *model;
            return if same {
                Ok(e.name.clone())
            } else {
                Err(Refused::Conflict(format!(
                    "version {} of {} is already deployed with another specification; versions are immutable: give this one a new version",
                    model.version, model.name
                )))
            };
        }
        model.validate()?;
        self.check_fallback(model)?;
        let key = rollout::entry_key(&model.name, &model.version);
        if self.models.len() >= MAX_ENTRIES {
            return Err(Refused::Conflict(format!(
                "{MAX_ENTRIES} models already; retire old versions first"
            )));
        }
        self.models.insert(
            key.clone(),
            Model {
                name: key.clone(),
                serves: Some(model.name.clone()),
                ..model.clone()
            },
        );
        Ok(key)
    }

    /// Starts a rollout (validated against the registry as it is when applied).
    pub fn start_rollout(&mut self, r: &Rollout) -> Result<(), Refused> {
        r.validate()?;
        if let Some(a) = self.active_rollout(&r.model) {
            return Err(Refused::Conflict(format!(
                "{} is already rolling out version {} ({}); promote or abort it first",
                r.model,
                a.to_version,
                a.state.as_str()
            )));
        }
        let Some(to) = self.models.get(&r.to) else {
            return Err(Refused::NotFound(format!(
                "no version {} of {}; `lanectl model deploy FILE` deploys it first",
                r.to_version, r.model
            )));
        };
        if to.public_name() != r.model {
            return Err(format!("{} is not a version of {}", r.to, r.model).into());
        }
        let class = self.classes.get(&to.class);
        if class.is_some_and(|c| c.lane == LaneKind::Durable) {
            return Err(format!(
                "{} is in a durable class: rollouts split synchronous traffic (sync and bounded lanes); jobs are not split between versions yet",
                r.model
            ).into());
        }
        let serving = self.serving_entry(&r.model);
        if serving == r.to {
            return Err(Refused::Conflict(format!(
                "version {} already serves {}",
                r.to_version, r.model
            )));
        }
        if serving != r.from {
            return Err(Refused::Conflict(format!(
                "{} is served by {serving}, not {}: start the rollout again",
                r.model, r.from
            )));
        }
        self.rollouts.insert(r.model.clone(), r.clone());
        Ok(())
    }

    /// Moves a rollout on. `expect_step`: only if it is still at that step (the loop judged that
    /// step; a retried or stale proposal does nothing).
    pub fn update_rollout(
        &mut self,
        model: &str,
        expect_step: Option<usize>,
        action: RolloutAction,
        at_ms: u64,
        message: &str,
    ) -> Result<(), Refused> {
        let replicas = &self.placement.replicas;
        let Some(r) = self.rollouts.get_mut(model) else {
            return Err(Refused::NotFound(format!(
                "{model} has no rollout; `lanectl rollout start` starts one"
            )));
        };
        if !r.state.is_active() {
            return Err(Refused::Conflict(format!(
                "the rollout of {model} to version {} has ended ({}); start a new one",
                r.to_version,
                r.state.as_str()
            )));
        }
        if expect_step.is_some_and(|s| s != r.step) {
            return Err(Refused::Conflict(format!(
                "the rollout of {model} is at step {}, not {}: already moved on",
                r.step,
                expect_step.unwrap_or_default()
            )));
        }
        let mut promoted = false;
        match action {
            RolloutAction::Advance if r.state == RolloutState::Running && r.step + 1 < r.steps.len() => {
                r.step += 1;
                r.step_started_ms = at_ms;
            }
            RolloutAction::Advance => {
                return Err(Refused::Conflict(format!(
                    "the rollout of {model} cannot advance now ({})",
                    r.state.as_str()
                )))
            }
            // A shadow moves no traffic: promoting it ends the comparison as passed.
            RolloutAction::Promote if r.strategy == rollout::Strategy::Shadow => r.state = RolloutState::Passed,
            // A promotion needs a ready replica of the new version.
            RolloutAction::Promote if ready_replicas(replicas, &r.to) == 0 => {
                return Err(Refused::Conflict(format!(
                    "version {} of {model} has no ready replica yet: promoting now would send every request to nothing; wait for its replicas (`lanectl rollout status {model}`) or abort",
                    r.to_version
                )))
            }
            RolloutAction::Promote => {
                r.state = RolloutState::Promoted;
                r.step = r.steps.len() - 1;
                promoted = true;
            }
            RolloutAction::RollBack => r.state = RolloutState::RolledBack,
            RolloutAction::Abort => r.state = RolloutState::Aborted,
            RolloutAction::Pause => r.state = RolloutState::Paused,
            RolloutAction::Resume => {
                r.state = RolloutState::Running;
                // The step bakes again from now: what it served while held is still counted.
                r.step_started_ms = at_ms;
            }
        }
        r.note(at_ms, message.to_string());
        if promoted {
            let to = r.to.clone();
            if to == model {
                self.serving.remove(model);
            } else {
                self.serving.insert(model.to_string(), to);
            }
        }
        Ok(())
    }

    pub fn remove_model(&mut self, name: &str) -> Result<(), Refused> {
        if let Some(m) = self.models.get(name) {
            let public = m.public_name();
            if self.serving_entry(public) == name
                && self
                    .models
                    .values()
                    .any(|o| o.public_name() == public && o.name != name)
            {
                return Err(Refused::Conflict(format!(
                    "{name} serves {public} while other versions exist; roll out another version first"
                )));
            }
            if self
                .active_rollout(public)
                .is_some_and(|r| r.to == name || r.from == name)
            {
                return Err(Refused::Conflict(format!(
                    "{name} is in the running rollout of {public}; promote or abort it first"
                )));
            }
        }
        self.models
            .remove(name)
            .map(|_| ())
            .ok_or_else(|| Refused::NotFound(format!("no model {name}; `lanectl model list` shows the models")))
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod example_tests {
    #[test]
    fn the_example_model_file_is_valid() {
        let m: super::Model = toml::from_str(include_str!("../../../../deploy/examples/models/whisper.toml")).unwrap();
        m.validate().unwrap();
        assert_eq!(m.profiles["L4"].max_batch, 8);
    }
}
