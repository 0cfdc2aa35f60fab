"""HistoPipe: history-aware rollout scheduling (length predictor, cost model, planner, scheduler)."""

from rhymerl.histopipe.cost import DecodeCostModel
from rhymerl.histopipe.planner import HistoPipePlanner, NoopPlanner, Plan, PromptGroup
from rhymerl.histopipe.predictor import LengthPredictor
from rhymerl.histopipe.scheduler import HistoPipePolicy, Move, Policy, PriorityPolicy, Scheduler, StaticPolicy

__all__ = ["DecodeCostModel", "HistoPipePlanner", "HistoPipePolicy", "LengthPredictor", "Move", "NoopPlanner", "Plan",
           "Policy", "PriorityPolicy", "PromptGroup", "Scheduler", "StaticPolicy"]
