"""The site aggregator daemon of hierarchical federations (`fedmq aggregator`, docs/hierarchy.md).

One aggregator sits at a site's broker: upstream it is one node of the federation, downstream the
coordinator of the site's nodes. Each task from upstream becomes a site round whose accepted updates
go upstream as one partial update, so the coordinator and the central broker see one update per site
instead of one per node. Methods whose aggregation cannot be split into parts are refused.
"""

from fedmq.aggregator.daemon import SiteAggregator
from fedmq.aggregator.site import Partial, SiteCoordinator
from fedmq.aggregator.upstream import SiteTrainer, no_data

__all__ = ["Partial", "SiteAggregator", "SiteCoordinator", "SiteTrainer", "no_data"]
