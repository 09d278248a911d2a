//! A model's config.json as read from disk (`--model path/config.json`): parsing must never
//! panic, and a config that parses must build a model whose sizes do not overflow.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weightsync_schedules::model::ModelConfig;
use weightsync_schedules::{ExpertForm, Model};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(config) = ModelConfig::from_json(text) else {
        return;
    };
    for experts in [ExpertForm::Stacked, ExpertForm::PerExpert] {
        let model = Model::from_config("fuzz", config.clone(), experts);
        let _ = model.params.len();
    }
});
