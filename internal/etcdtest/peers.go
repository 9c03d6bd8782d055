package etcdtest

import (
	"fmt"
	"slices"
)

// CutPeers cuts m off from its peers: every raft connection between m and
// another member stalls in both directions, as in a network partition. The
// connections stay open and nothing is dropped; what was sent is held and
// delivered in order by HealPeers. That covers every connection through m's
// own peer proxy (whoever the sender) and, in the other members' proxies,
// every connection m opened; connections opened while cut stall too. m's
// client port keeps serving, from m's possibly stale state.
//
// In etcd v3.7.3 rafthttp's 5s stream read/write timeouts are not applied
// (NewTimeoutTransport sets http.Transport.Dial, which its DialContext
// overrides), so a stalled stream stays up however long the cut lasts and
// delivers its backlog on heal. A cut longer than the election timeout
// (500ms here) makes m a pre-candidate without a leader: proposals its
// clients make from then on block in raft until their context ends and are
// never sent. Pre-vote and check-quorum keep the rest of the cluster's
// leader in place. CutPeers needs Options.PeerProxies.
func (c *Cluster) CutPeers(m *Member) error {
	return c.setCut(m, true)
}

// HealPeers ends CutPeers(m): held traffic is delivered in order and flows again.
func (c *Cluster) HealPeers(m *Member) error {
	return c.setCut(m, false)
}

func (c *Cluster) setCut(m *Member, cut bool) error {
	if !c.opts.PeerProxies {
		return fmt.Errorf("etcdtest: cutting peers needs Options.PeerProxies")
	}
	if m == nil || !slices.Contains(c.members, m) {
		return fmt.Errorf("etcdtest: not a member of this cluster")
	}
	id := m.ID()
	if id == 0 {
		return fmt.Errorf("etcdtest: %s has no member ID yet", m.Name)
	}
	c.peerMu.Lock()
	if cut {
		c.cut[m] = id
	} else {
		delete(c.cut, m)
	}
	c.peerMu.Unlock()
	c.notifyPeerProxies()
	return nil
}

// peerStalled is the policy of owner's peer proxy: everything stalls while
// owner is cut; otherwise a connection stalls while its sender is cut, and
// one from an unknown sender flows.
func (c *Cluster) peerStalled(owner *Member) func(from uint64) bool {
	return func(from uint64) bool {
		c.peerMu.Lock()
		defer c.peerMu.Unlock()
		if _, ok := c.cut[owner]; ok {
			return true
		}
		for _, id := range c.cut {
			if from != 0 && from == id {
				return true
			}
		}
		return false
	}
}

func (c *Cluster) notifyPeerProxies() {
	for _, m := range c.members {
		if m.proxy != nil {
			m.proxy.notify()
		}
	}
}
